"""The adopter's view of mlx-lm's prompt cache: a :class:`~...adopter.ports.DetachedEntryStore`.

An entry of ``LRUPromptCache`` is one request's whole cache (a list of layer caches)
stored under its token sequence. Adopting a block-floored prefix of it builds a new
cache for the request: each trimmable layer is a copy of the entry's, trimmed to the
boundary; each other layer is a copy of the boundary snapshot's. The entry itself is
never touched, so it stays whole for its siblings (clone semantics; "pins" here are the
entry's presence in the host's trie). The copies belong to the request: releasing one
only drops the adopter's reference.

Threads: called from mlx-lm's generation thread only (inside ``fetch_nearest_cache``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ...adopter.ports import EntryLayout, PinsNotOwnedError
from . import layers as layer_ops
from .snapshots import SnapshotStore


@dataclass(slots=True)
class EntryRef:
    """A stored entry as one lookup saw it: the host's trie, the entry's tokens, and the
    lookup prompt (the snapshot must be a prefix of both)."""

    trie: Any
    model: Hashable
    entry_tokens: list[int]
    prompt: list[int]
    boundaries: frozenset[int]


@dataclass(slots=True)
class Taken:
    """Trim mode's one-shot handle: the entry ref, and the cache once trimmed."""

    ref: EntryRef
    cache: list[Any] | None = field(default=None)


class PromptCacheStore:
    """Builds adopted caches from an entry and the snapshot store."""

    def __init__(self, snapshots: SnapshotStore, block_size: int) -> None:
        self.snapshots = snapshots
        self.block_size = block_size

    def describe(self, entry: object) -> EntryLayout:
        ref = _ref(entry)
        return EntryLayout(
            tokens=len(ref.entry_tokens),
            block_size=self.block_size,
            # A wrapped window is restored from the snapshot, not cut, so the adopted
            # state starts at position 0 like the snapshot's own.
            logical_start=0,
            recurrent=True,
            snapshot_boundaries=ref.boundaries,
            owns_pins=self._present(ref),
        )

    def clone_prefix(self, entry: object, tokens: int, *, owner: str) -> object:
        return self._build(_ref(entry), tokens)

    def take(self, entry: object) -> object:
        ref = _ref(entry)
        if not self._present(ref):
            raise PinsNotOwnedError("the entry left the prompt cache")
        return Taken(ref)

    def trim(self, detached: object, tokens: int) -> None:
        if not isinstance(detached, Taken):
            raise ValueError("not a handle this store took")
        detached.cache = self._build(detached.ref, tokens)

    def release(self, detached: object) -> None:
        if isinstance(detached, Taken):
            detached.cache = None

    # -- internals -------------------------------------------------------------------

    def _present(self, ref: EntryRef) -> bool:
        try:
            ref.trie.get(ref.model, ref.entry_tokens)
        except KeyError:
            return False
        return True

    def _build(self, ref: EntryRef, tokens: int) -> list[Any]:
        if tokens <= 0 or tokens % self.block_size or tokens >= len(ref.entry_tokens):
            raise ValueError(f"cannot adopt {tokens} of {len(ref.entry_tokens)} tokens at block {self.block_size}")
        snapshot = self.snapshots.get(ref.model, ref.prompt[:tokens])
        if snapshot is None:
            raise ValueError(f"no snapshot at {tokens}")
        try:
            entry = ref.trie.get(ref.model, ref.entry_tokens)
        except KeyError as exc:
            raise PinsNotOwnedError("the entry left the prompt cache") from exc
        drop = len(ref.entry_tokens) - tokens
        cache = []
        for index, layer in enumerate(entry.prompt_cache):
            saved = snapshot.layers.get(index)
            cache.append(layer_ops.copy_layer(saved) if saved is not None else layer_ops.trimmed_copy(layer, drop))
        self.snapshots.count_use()
        return cache


def adopted_cache(handle: object) -> list[Any] | None:
    """The cache a decision's handle carries (clone: the list; trim: the taken one's)."""
    if isinstance(handle, Taken):
        return handle.cache
    return handle if isinstance(handle, list) else None


def _ref(entry: object) -> EntryRef:
    if not isinstance(entry, EntryRef):
        raise ValueError("not an entry of this store")
    return entry
