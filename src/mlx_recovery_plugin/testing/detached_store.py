"""The mock host's store of detached paged sets, as a paged MLX server keeps them.

When a request finishes, a paged server keeps its blocks as a *detached set* and indexes
it as a stored prefix entry. Every block of a stored set carries two references: the
allocation (``<set>/alloc``) and the detach pin (``<set>/pin``). A clone made for an
adopting request references the same physical blocks with one pin each
(``<clone>/pin``), so the stored entry stays whole for every other request.

:meth:`DetachedStore.admit` is the server's entry lookup. Without the adopter it adopts a
whole-entry match, and a partial match as ``partial`` says: ``"decline"`` (the default)
refuses it, ``"whole_blocks"`` restores the whole blocks of the shared prefix, clone-and-pin
(as oMLX, whose paged cache matches whole blocks, does); with a plugin manager it asks the
``prefix_lookup`` hook through :class:`~mlx_recovery_plugin.plugins.HookEmitter` and
restores from the decision.

Threads: the store is shared by the threads that admit requests; every public method
holds ``_lock`` for its whole body, so each is atomic, and the hook is called outside
the lock, so concurrent admissions race on an entry as they would on a real server.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
import pluggy
from mlx_lm.models.cache import ArraysCache

from ..adopter.ports import EntryLayout, PinError, PinsNotOwnedError, ReleaseErrors
from ..events import PrefixLookup
from ..kvcodec import (
    blocks_from_cache,
    cache_from_blocks,
    cache_offset,
    kv_positions,
    recurrent_snapshot,
)
from ..plugins import HookEmitter
from ..recovery.jobs import common_prefix_len
from ..state import BlockState, KVBlock, LayerBlock, RecurrentSnapshot, floor_block
from .block_pool import BlockPool, PoolExhaustedError


@dataclass(slots=True, eq=False)
class DetachedSet:
    """One detached set: ``tokens`` covered by ``block_ids`` (the last block may be partly
    filled). ``alloc_holder`` is None for a clone, which owns pins only. ``layer_offsets``
    are the per-layer positions a restore resumes at."""

    set_id: str
    tokens: tuple[int, ...] = field(repr=False)
    block_ids: list[int]
    pin_holder: str
    alloc_holder: str | None
    layer_offsets: list[int]
    side_data: dict[int, object] = field(default_factory=dict)
    logical_start: int = 0
    recurrent: bool = False
    snapshot_boundaries: frozenset[int] = frozenset()
    owns_pins: bool = True
    indexed: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(slots=True, frozen=True)
class Admission:
    """What the entry lookup gave a request: ``cached_tokens`` restored from ``handle``
    (None for a cold prefill); ``reason`` as the adopter or the plain path named it."""

    request_id: str
    cached_tokens: int
    handle: DetachedSet | None
    reason: str
    entry_id: str | None = None
    matched_tokens: int = 0


class DetachedStore:
    """Detached sets over a :class:`BlockPool`, indexed as stored prefix entries.

    ``can_clone=False`` makes the plain path take whole entries (one-shot) instead of
    cloning them. ``partial`` is what the plain path does with a partial match:
    ``"decline"`` it, or restore its ``"whole_blocks"`` (clone-and-pin of the block-floored
    shared prefix, whatever ``can_clone`` says). ``fail_pin_on`` injects a fault: it returns True for a block id whose
    pin should fail (as when a host's pin table is full).
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        pm: pluggy.PluginManager | None = None,
        engine_id: str = "engine-0",
        can_clone: bool = True,
        partial: Literal["decline", "whole_blocks"] = "decline",
    ) -> None:
        if partial not in ("decline", "whole_blocks"):
            raise ValueError(f"partial must be 'decline' or 'whole_blocks', got {partial!r}")
        self.pool = pool
        self.block_size = pool.block_size
        self.engine_id = engine_id
        self.can_clone = can_clone
        self.partial = partial
        self.emitter = HookEmitter(pm) if pm is not None else None
        self.fail_pin_on: Callable[[int], bool] | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._entries: dict[str, DetachedSet] = {}
        self._by_first_block: dict[tuple[int, ...], dict[str, DetachedSet]] = {}
        self._live: dict[str, DetachedSet] = {}

    # -- storing ------------------------------------------------------------------
    def store(
        self,
        tokens: Sequence[int],
        blocks: Sequence[BlockState] | None = None,
        *,
        num_layers: int = 1,
        side_data: Mapping[int, object] | None = None,
        logical_start: int = 0,
        recurrent: bool | None = None,
        snapshot_boundaries: Sequence[int] | None = None,
    ) -> DetachedSet:
        """Detach ``tokens`` into a new indexed set of ``ceil(len / B)`` blocks.

        ``blocks`` (one per block, the last possibly partial) carry the states; without
        them the set is bookkeeping only. Recurrent layout is read from the states
        unless given: snapshots exist at every block end and at the set's end.
        """
        tokens = tuple(tokens)
        n_blocks = -(-len(tokens) // self.block_size)
        if not tokens:
            raise ValueError("cannot store an empty entry")
        if blocks is not None and len(blocks) != n_blocks:
            raise ValueError(f"{len(tokens)} tokens need {n_blocks} block states, got {len(blocks)}")
        if recurrent is None:
            recurrent = blocks is not None and any(
                isinstance(layer, RecurrentSnapshot) for b in blocks for layer in b.layers
            )
        if snapshot_boundaries is None:
            snapshot_boundaries = self._default_boundaries(len(tokens)) if recurrent else ()
        if blocks is not None:
            num_layers = len(blocks[0].layers)
        with self._lock:
            if not self.pool.can_allocate(n_blocks):
                raise PoolExhaustedError(f"pool cannot hold {n_blocks} more blocks")
            set_id = f"set-{next(self._ids)}"
            entry = DetachedSet(
                set_id=set_id,
                tokens=tokens,
                block_ids=[],
                pin_holder=f"{set_id}/pin",
                alloc_holder=f"{set_id}/alloc",
                layer_offsets=[len(tokens)] * num_layers,
                side_data=dict(side_data or {}),
                logical_start=logical_start,
                recurrent=recurrent,
                snapshot_boundaries=frozenset(snapshot_boundaries),
            )
            for i in range(n_blocks):
                block_id = self.pool.allocate(entry.alloc_holder)  # type: ignore[arg-type]
                self.pool.incref(block_id, entry.pin_holder)
                if blocks is not None:
                    self.pool.put(block_id, blocks[i])
                entry.block_ids.append(block_id)
            self._live[set_id] = entry
            self._index(entry)
            return entry

    def store_cache(self, tokens: Sequence[int], cache: Sequence[Any], **layout: Any) -> DetachedSet:
        """Detach a live mlx-lm prompt cache that has consumed exactly ``tokens``."""
        offset = cache_offset(cache)
        if offset != len(tokens):
            raise ValueError(f"cache holds {offset} positions, {len(tokens)} tokens given")
        whole = len(tokens) // self.block_size
        blocks = blocks_from_cache(cache, 0, whole, self.block_size)
        if len(tokens) % self.block_size:
            blocks.append(_tail_block(cache, whole, whole * self.block_size, len(tokens)))
        return self.store(tokens, blocks, **layout)

    def _default_boundaries(self, length: int) -> list[int]:
        return [*range(self.block_size, length + 1, self.block_size), length]

    # -- the entry lookup ---------------------------------------------------------
    def match(self, prompt: Sequence[int]) -> tuple[DetachedSet | None, int]:
        """The indexed entry sharing the longest prefix with ``prompt``, and its length.

        At most ``len(prompt) - 1`` tokens match: the last prompt token is always
        prefilled, since its logits start the answer.
        """
        prompt = tuple(prompt)
        limit = len(prompt) - 1
        best, best_len = None, 0
        with self._lock:
            for entry in self._by_first_block.get(prompt[: self.block_size], {}).values():
                n = common_prefix_len(entry.tokens, prompt, limit)
                if n > best_len or (n == best_len and best is not None and n == entry.length):
                    best, best_len = entry, n
            if best is None:
                for entry in self._entries.values():
                    n = common_prefix_len(entry.tokens, prompt, limit)
                    if n > best_len:
                        best, best_len = entry, n
        return best, best_len

    def admit(self, request_id: str, prompt: Sequence[int]) -> Admission:
        """Find the best stored entry for ``prompt`` and decide what to restore from it."""
        entry, matched = self.match(prompt)
        if entry is None or matched == 0:
            return Admission(request_id, 0, None, "no_match")
        if self.emitter is not None:
            lookup = PrefixLookup(
                engine_id=self.engine_id,
                request_id=request_id,
                entry_id=entry.set_id,
                entry_tokens=entry.length,
                matched_tokens=matched,
                block_size=self.block_size,
                entry=entry,
                store=self,
            )
            decision = self.emitter.prefix_lookup(lookup)
            if decision is not None:
                handle = decision.handle if decision.adopted else None
                return Admission(
                    request_id, decision.adopt_tokens, handle, decision.reason, entry.set_id, matched
                )
        return self._plain(request_id, entry, matched)

    def _plain(self, request_id: str, entry: DetachedSet, matched: int) -> Admission:
        if matched != entry.length:
            if self.partial == "whole_blocks":
                return self._whole_blocks(request_id, entry, matched)
            return Admission(request_id, 0, None, "declined_partial", entry.set_id, matched)
        try:
            if self.can_clone:
                handle = self.clone_prefix(entry, entry.length, owner=request_id)
            else:
                handle = self.take(entry)
        except (PinError, PinsNotOwnedError):
            return Admission(request_id, 0, None, "pin_failed", entry.set_id, matched)
        return Admission(request_id, entry.length, handle, "whole", entry.set_id, matched)

    def _whole_blocks(self, request_id: str, entry: DetachedSet, matched: int) -> Admission:
        """A partial match restores the whole blocks of the shared prefix, nothing checked
        beyond that (no side data, window or snapshot rules: the host's own matching)."""
        target = floor_block(matched, self.block_size)
        if target == 0:
            return Admission(request_id, 0, None, "below_block", entry.set_id, matched)
        try:
            handle = self.clone_prefix(entry, target, owner=request_id)
        except (PinError, PinsNotOwnedError):
            return Admission(request_id, 0, None, "pin_failed", entry.set_id, matched)
        return Admission(request_id, target, handle, "whole_blocks", entry.set_id, matched)

    # -- DetachedEntryStore -------------------------------------------------------
    def describe(self, entry: object) -> EntryLayout:
        s = _as_set(entry)
        with self._lock:
            return EntryLayout(
                tokens=s.length,
                block_size=self.block_size,
                side_data_blocks=frozenset(s.side_data),
                logical_start=s.logical_start,
                recurrent=s.recurrent,
                snapshot_boundaries=s.snapshot_boundaries,
                owns_pins=s.owns_pins,
            )

    def clone_prefix(self, entry: object, tokens: int, *, owner: str) -> DetachedSet:
        s = _as_set(entry)
        with self._lock:
            if not s.owns_pins:
                raise PinsNotOwnedError(f"{s.set_id} no longer owns its pins")
            self._check_target(s, tokens, whole_ok=True)
            kept = -(-tokens // self.block_size)
            set_id = f"set-{next(self._ids)}"
            clone = DetachedSet(
                set_id=set_id,
                tokens=s.tokens[:tokens],
                block_ids=[],
                pin_holder=f"{set_id}/pin:{owner}",
                alloc_holder=None,
                layer_offsets=[min(o, tokens) for o in s.layer_offsets],
                side_data={i: d for i, d in s.side_data.items() if i < kept},
                logical_start=s.logical_start,
                recurrent=s.recurrent,
                snapshot_boundaries=frozenset(b for b in s.snapshot_boundaries if b <= tokens),
            )
            for block_id in s.block_ids[:kept]:
                try:
                    if self.fail_pin_on is not None and self.fail_pin_on(block_id):
                        raise PinError(f"cannot pin block {block_id}")
                    self.pool.incref(block_id, clone.pin_holder)
                except Exception as exc:
                    for taken in clone.block_ids:
                        self.pool.decref(taken, clone.pin_holder)
                    raise exc if isinstance(exc, PinError) else PinError(str(exc)) from exc
                clone.block_ids.append(block_id)
            self._live[set_id] = clone
            return clone

    def take(self, entry: object) -> DetachedSet:
        s = _as_set(entry)
        with self._lock:
            if not s.owns_pins or not s.indexed:
                raise PinsNotOwnedError(f"{s.set_id} was already taken or released")
            self._unindex(s)
            return s

    def trim(self, detached: object, tokens: int) -> None:
        s = _as_set(detached)
        with self._lock:
            if not s.owns_pins:
                raise PinsNotOwnedError(f"{s.set_id} no longer owns its pins")
            self._check_target(s, tokens, whole_ok=False)
            kept = tokens // self.block_size
            if any(i >= kept for i in s.side_data):
                raise ValueError(f"{s.set_id}: side data is keyed by blocks a trim would drop")
            if s.logical_start != 0:
                raise ValueError(f"{s.set_id}: sliding-window state starts at {s.logical_start}")
            if s.recurrent and tokens not in s.snapshot_boundaries:
                raise ValueError(f"{s.set_id}: no recurrent snapshot at {tokens}")
            if tokens == s.length:
                return
            dropped = s.block_ids[kept:]
            errors = self._release_blocks(s, dropped)
            # Bookkeeping is finished before any error is reported.
            was_indexed = s.indexed
            if was_indexed:
                self._unindex(s)
            del s.block_ids[kept:]
            s.tokens = s.tokens[:tokens]
            s.layer_offsets = [min(o, tokens) for o in s.layer_offsets]
            s.snapshot_boundaries = frozenset(b for b in s.snapshot_boundaries if b <= tokens)
            if was_indexed:
                self._index(s)
            if errors:
                raise ReleaseErrors(errors)

    def release(self, detached: object) -> None:
        s = _as_set(detached)
        with self._lock:
            if not s.owns_pins:
                return
            errors = self._release_blocks(s, s.block_ids)
            if s.indexed:
                self._unindex(s)
            s.block_ids = []
            s.owns_pins = False
            self._live.pop(s.set_id, None)
            if errors:
                raise ReleaseErrors(errors)

    # -- restoring ----------------------------------------------------------------
    def restore(self, handle: DetachedSet, make_cache: Callable[[], list[Any]]) -> list[Any]:
        """A fresh mlx-lm prompt cache holding the set's positions, resuming at its length.

        The blocks are copied into the new cache, so the request's own positions never
        land in a block another set reads.
        """
        with self._lock:
            if not handle.owns_pins:
                raise PinsNotOwnedError(f"{handle.set_id} was released")
            blocks = [self.pool.get(b) for b in handle.block_ids]
            offsets = list(handle.layer_offsets)
        cache = cache_from_blocks(make_cache, blocks)
        for layer, expected in zip(cache, offsets):
            if not isinstance(layer, ArraysCache) and layer.offset != expected:
                raise ValueError(f"restored layer at {layer.offset}, set says {expected}")
        return cache

    # -- evicting and inspecting --------------------------------------------------
    def evict(self, entry: object) -> None:
        """Drop a stored entry: unindex it and give back both references of its blocks.
        Clones keep the blocks they pinned alive."""
        self.release(entry)

    def entries(self) -> list[DetachedSet]:
        with self._lock:
            return list(self._entries.values())

    def live_sets(self) -> list[DetachedSet]:
        """Every set (stored entry or handed-out clone/taken set) not yet released."""
        with self._lock:
            return list(self._live.values())

    def expected_refcounts(self) -> dict[int, int]:
        """Block -> references the live sets account for (2 per stored block, 1 per pin)."""
        with self._lock:
            counts: dict[int, int] = {}
            for s in self._live.values():
                per_block = 2 if s.alloc_holder is not None else 1
                for block_id in s.block_ids:
                    counts[block_id] = counts.get(block_id, 0) + per_block
            return counts

    # -- internals (lock held) ----------------------------------------------------
    def _check_target(self, s: DetachedSet, tokens: int, *, whole_ok: bool) -> None:
        if tokens <= 0 or tokens > s.length:
            raise ValueError(f"target {tokens} is outside {s.set_id}'s 1..{s.length} tokens")
        if tokens % self.block_size and not (whole_ok and tokens == s.length):
            raise ValueError(f"target {tokens} is not a multiple of the {self.block_size}-token block")

    def _release_blocks(self, s: DetachedSet, block_ids: Sequence[int]) -> list[BaseException]:
        errors: list[BaseException] = []
        holders = [h for h in (s.alloc_holder, s.pin_holder) if h is not None]
        for block_id in list(block_ids):
            for holder in holders:
                try:
                    self.pool.decref(block_id, holder)
                except Exception as exc:  # noqa: BLE001 - collected, reported after bookkeeping
                    errors.append(exc)
        return errors

    def _index(self, s: DetachedSet) -> None:
        self._entries[s.set_id] = s
        self._by_first_block.setdefault(s.tokens[: self.block_size], {})[s.set_id] = s
        s.indexed = True

    def _unindex(self, s: DetachedSet) -> None:
        self._entries.pop(s.set_id, None)
        key = s.tokens[: self.block_size]
        bucket = self._by_first_block.get(key)
        if bucket is not None:
            bucket.pop(s.set_id, None)
            if not bucket:
                del self._by_first_block[key]
        s.indexed = False


def _as_set(entry: object) -> DetachedSet:
    if not isinstance(entry, DetachedSet):
        raise TypeError(f"not a detached set of this store: {type(entry).__name__}")
    return entry


def _tail_block(cache: Sequence[Any], index: int, start: int, end: int) -> BlockState:
    """The partly filled last block ``[start, end)`` of a live cache, as compact copies."""
    layers: list[LayerBlock] = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layers.append(recurrent_snapshot(layer))
        else:
            layers.append(KVBlock(*kv_positions(layer, start, end)))
    block = BlockState(index, tuple(layers))
    mx.eval(block.arrays())
    return block
