"""Boundary snapshots: the state of an entry's non-trimmable layers at a block boundary.

A snapshot is keyed by the model key and the exact token prefix it was taken after
(lineage is the token prefix), so it serves every stored entry that starts with those
tokens. It is *pending* from the moment it is taken until the host stores an entry that
extends it (the request's own segment end or finish), then *attached*; an attached
snapshot whose last extending entry the host evicted is dropped (it can no longer be
combined with any entry's trimmable layers; checked for the evicted entry's own block
boundaries only, so the cost follows what the host evicted, not what is held). The store keeps at most ``budget_bytes``
and evicts the least recently used snapshot first.

Threads: mlx-lm's server calls its prompt cache only from its generation thread, so
``put`` / ``get`` / ``attach`` / ``prune`` run there; ``status`` may run on an HTTP
thread. ``_lock`` guards everything (held briefly; no MLX work under it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class SnapshotOutcome(str, Enum):
    """What happened to a snapshot the host's prefill offered."""

    STORED = "stored"
    ALREADY_HELD = "already_held"
    OVER_BUDGET = "over_budget"


@dataclass(slots=True)
class Snapshot:
    """``layers``: layer index -> the layer cache as it was after ``boundary`` tokens."""

    boundary: int
    layers: dict[int, Any]
    nbytes: int
    attached: bool = False


@dataclass(slots=True)
class _Counters:
    stored: int = 0
    bytes_stored: int = 0
    already_held: int = 0
    over_budget: int = 0
    evicted_budget: int = 0
    dropped_orphan: int = 0
    used: int = 0


Key = tuple[Hashable, tuple[int, ...]]


class SnapshotStore:
    """Snapshots within a byte budget, least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._snapshots: OrderedDict[Key, Snapshot] = OrderedDict()
        self._bytes = 0
        self._counters = _Counters()

    def __len__(self) -> int:
        with self._lock:
            return len(self._snapshots)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def holds(self, model: Hashable, tokens: Sequence[int]) -> bool:
        with self._lock:
            return (model, tuple(tokens)) in self._snapshots

    def put(self, model: Hashable, tokens: Sequence[int], layers: dict[int, Any], nbytes: int) -> SnapshotOutcome:
        """Keep ``layers`` as the state after ``tokens``; evicts older snapshots to fit."""
        key = (model, tuple(tokens))
        with self._lock:
            if key in self._snapshots:
                self._snapshots.move_to_end(key)
                self._counters.already_held += 1
                return SnapshotOutcome.ALREADY_HELD
            if nbytes > self.budget_bytes:
                self._counters.over_budget += 1
                return SnapshotOutcome.OVER_BUDGET
            while self._bytes + nbytes > self.budget_bytes and self._snapshots:
                _, old = self._snapshots.popitem(last=False)
                self._bytes -= old.nbytes
                self._counters.evicted_budget += 1
            self._snapshots[key] = Snapshot(len(key[1]), layers, nbytes)
            self._bytes += nbytes
            self._counters.stored += 1
            self._counters.bytes_stored += nbytes
            return SnapshotOutcome.STORED

    def get(self, model: Hashable, tokens: Sequence[int]) -> Snapshot | None:
        """The snapshot taken after exactly ``tokens`` (marked recently used), or None."""
        key = (model, tuple(tokens))
        with self._lock:
            snapshot = self._snapshots.get(key)
            if snapshot is not None:
                self._snapshots.move_to_end(key)
            return snapshot

    def boundaries(self, model: Hashable, tokens: Sequence[int], block: int, upto: int) -> list[int]:
        """Block boundaries ``b <= upto`` with a snapshot after ``tokens[:b]``, longest first."""
        found: list[int] = []
        with self._lock:
            if not self._snapshots:
                return found
            for boundary in range((min(upto, len(tokens)) // block) * block, 0, -block):
                if (model, tuple(tokens[:boundary])) in self._snapshots:
                    found.append(boundary)
        return found

    def count_use(self) -> None:
        with self._lock:
            self._counters.used += 1

    def attach(self, model: Hashable, tokens: Sequence[int], block: int) -> None:
        """The host stored an entry of ``tokens``: the snapshots it extends are attached.
        Snapshots lie on block multiples, so only those keys are looked at."""
        with self._lock:
            for boundary in range(block, len(tokens), block):
                snapshot = self._snapshots.get((model, tuple(tokens[:boundary])))
                if snapshot is not None:
                    snapshot.attached = True

    def prune_under(
        self, model: Hashable, tokens: Sequence[int], block: int,
        extended: Callable[[Hashable, tuple[int, ...]], bool],
    ) -> int:
        """The host evicted the entry of ``tokens``: drop the attached snapshots on its
        block multiples that no stored entry extends any more; how many."""
        dropped = 0
        with self._lock:
            for boundary in range(block, len(tokens), block):
                key = (model, tuple(tokens[:boundary]))
                snapshot = self._snapshots.get(key)
                if snapshot is not None and snapshot.attached and not extended(*key):
                    self._bytes -= self._snapshots.pop(key).nbytes
                    dropped += 1
            self._counters.dropped_orphan += dropped
        return dropped

    def drop_pending(self, model: Hashable, tokens: Sequence[int], block: int) -> int:
        """A request left before the host stored any entry of ``tokens``: drop the
        snapshots on its block multiples that no entry extends yet; how many."""
        dropped = 0
        with self._lock:
            for boundary in range(block, len(tokens), block):
                key = (model, tuple(tokens[:boundary]))
                snapshot = self._snapshots.get(key)
                if snapshot is not None and not snapshot.attached:
                    self._bytes -= self._snapshots.pop(key).nbytes
                    dropped += 1
            self._counters.dropped_orphan += dropped
        return dropped

    def pending(self) -> int:
        with self._lock:
            return sum(not s.attached for s in self._snapshots.values())

    def clear(self) -> None:
        with self._lock:
            self._snapshots.clear()
            self._bytes = 0

    def status(self) -> dict[str, Any]:
        with self._lock:
            c = self._counters
            return {
                "budget_bytes": self.budget_bytes,
                "bytes": self._bytes,
                "snapshots": len(self._snapshots),
                "pending": sum(not s.attached for s in self._snapshots.values()),
                "stored": c.stored,
                "bytes_stored": c.bytes_stored,
                "already_held": c.already_held,
                "over_budget": c.over_budget,
                "evicted_budget": c.evicted_budget,
                "dropped_orphan": c.dropped_orphan,
                "used": c.used,
            }
