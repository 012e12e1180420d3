"""The mock host's prefix cache: whole blocks in a refcounted pool, found by chained hash.

Block ``k`` of a prompt is keyed by a hash of (model id, block ``k-1``'s key, the block's
tokens), so a block only matches when everything before it matched too, and a partial
block is never stored or found. The index holds one reference per stored block under the
holder ``"cache"``; a fetch takes one more per returned block under the fetcher's id, so a
block someone restored cannot be evicted under them. Eviction is least-recently-used among
leaves (blocks no stored block extends) that nobody but the index references.

Implements :class:`mlx_recovery_plugin.ports.PrefixCachePort`. Owned by the engine thread,
like the pool under it; not thread-safe by design.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..ports import FetchedPrefix
from ..state import BlockState
from .block_pool import BlockPool

log = logging.getLogger(__name__)

INDEX_HOLDER = "cache"

BlockDroppedCallback = Callable[[int], None]


def chain_hash(model_id: str, parent: int | None, tokens: Sequence[int]) -> int:
    """Key of one block: stable across processes (no salted ``hash()``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model_id.encode())
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class CacheCounters:
    """``stores``: blocks newly stored; ``fetches`` / ``fetch_hits``: fetch calls, and those
    that restored at least one block; ``hit_blocks``: blocks restored; ``evictions``."""

    stores: int = 0
    fetches: int = 0
    fetch_hits: int = 0
    hit_blocks: int = 0
    evictions: int = 0


@dataclass(slots=True)
class _Entry:
    key: int
    block_id: int
    parent: int | None
    tokens: tuple[int, ...]
    children: int = 0


@dataclass(slots=True)
class _Held:
    """References one holder took through :meth:`PagedPrefixCache.fetch`."""

    block_ids: list[int] = field(default_factory=list)


class PagedPrefixCache:
    """Whole-block prefix cache of one model over a :class:`BlockPool`."""

    def __init__(self, pool: BlockPool, model_id: str) -> None:
        self.pool = pool
        self.model_id = model_id
        self.counters = CacheCounters()
        # Single slot, like oMLX's ``on_block_hash_dropped``: whoever sets it chains the
        # previous value. Called with the chain hash of every block leaving the index.
        self.on_block_dropped: BlockDroppedCallback | None = None
        self._index: OrderedDict[int, _Entry] = OrderedDict()  # LRU order, oldest first
        self._held: dict[str, _Held] = {}

    # -- the port -------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        """The longest stored whole-block prefix of ``tokens``, one reference per block
        taken under ``holder_id`` (given back by :meth:`release`)."""
        self.counters.fetches += 1
        found = self._walk(tokens, touch=True)
        if not found:
            return FetchedPrefix(tokens=0)
        held = self._held.setdefault(holder_id, _Held())
        states: list[BlockState] = []
        for entry in found:
            self.pool.incref(entry.block_id, holder_id)
            held.block_ids.append(entry.block_id)
            states.append(self.pool.get(entry.block_id))
        self.counters.fetch_hits += 1
        self.counters.hit_blocks += len(found)
        return FetchedPrefix(tokens=len(found) * self.block_size, blocks=tuple(states))

    def release(self, holder_id: str) -> None:
        """Give back every reference ``holder_id`` took by fetching. Idempotent."""
        held = self._held.pop(holder_id, None)
        if held is None:
            return
        for block_id in held.block_ids:
            self.pool.decref(block_id, holder_id)

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[BlockState]) -> int:
        """Store the whole blocks of ``tokens`` whose states are in ``blocks`` (the last
        ``len(blocks)`` blocks). Blocks already stored are skipped; if a block before the
        given ones is missing (a gap), nothing is stored. Returns how many leading tokens
        of ``tokens`` the cache holds afterwards."""
        size = self.block_size
        whole = len(tokens) // size
        if whole * size != len(tokens):
            log.warning(
                "mlx-recovery mock: store of %d tokens by %r is not whole blocks of %d; "
                "the partial block is ignored", len(tokens), holder_id, size,
            )
        first = whole - len(blocks)
        if first < 0:
            log.warning("mlx-recovery mock: %r gave %d blocks for %d whole blocks; refused",
                        holder_id, len(blocks), whole)
            return len(self._walk(tokens, touch=False)) * size
        chain = self._walk(tokens[: whole * size], touch=True)
        if len(chain) < first:
            log.warning("mlx-recovery mock: store by %r refused: blocks %d..%d are not stored",
                        holder_id, len(chain), first - 1)
            return len(chain) * size
        end = whole
        for k in range(len(chain), whole):
            if blocks[k - first].index != k:
                log.warning("mlx-recovery mock: store by %r stops: block %d carries index %d",
                            holder_id, k, blocks[k - first].index)
                end = k
                break
        # The chain being extended must survive the evictions this store may cause.
        pin = f"store:{holder_id}"
        pinned = [entry.block_id for entry in chain]
        for block_id in pinned:
            self.pool.incref(block_id, pin)
        try:
            parent = chain[-1] if chain else None
            parent_hash = parent.key if parent is not None else None
            for k in range(len(chain), end):
                block_tokens = tuple(tokens[k * size : (k + 1) * size])
                key = chain_hash(self.model_id, parent_hash, block_tokens)
                block_id = self._allocate()
                if block_id is None:
                    log.warning("mlx-recovery mock: pool full; stored %d of %d blocks", k, whole)
                    break
                self.pool.put(block_id, blocks[k - first], chain_hash=key)
                entry = _Entry(key, block_id, parent_hash, block_tokens)
                self._index[key] = entry
                if parent is not None:
                    parent.children += 1
                self.pool.incref(block_id, pin)
                pinned.append(block_id)
                self.counters.stores += 1
                parent, parent_hash = entry, key
        finally:
            for block_id in pinned:
                self.pool.decref(block_id, pin)
        return len(self._walk(tokens[: whole * size], touch=False)) * size

    # -- host-side operations ---------------------------------------------------------
    def stored_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` a fetch would restore (takes nothing)."""
        return len(self._walk(tokens, touch=False)) * self.block_size

    def clear(self) -> None:
        """Drop every stored block from the index (a deep reset). Blocks someone still
        references stay allocated until they release them."""
        for key, entry in list(self._index.items()):
            del self._index[key]
            self.pool.decref(entry.block_id, INDEX_HOLDER)
            self._dropped(key)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def holders(self) -> list[str]:
        """Holders with fetch references outstanding."""
        return list(self._held)

    # -- private ------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], *, touch: bool) -> list[_Entry]:
        size = self.block_size
        found: list[_Entry] = []
        parent: int | None = None
        for k in range(len(tokens) // size):
            block_tokens = tuple(tokens[k * size : (k + 1) * size])
            key = chain_hash(self.model_id, parent, block_tokens)
            entry = self._index.get(key)
            if entry is None or entry.tokens != block_tokens:
                break
            if touch:
                self._index.move_to_end(key)
            found.append(entry)
            parent = key
        return found

    def _allocate(self) -> int | None:
        if not self.pool.can_allocate() and not self._evict_one():
            return None
        return self.pool.allocate(INDEX_HOLDER)

    def _evict_one(self) -> bool:
        """Evict the least recently used leaf that only the index references."""
        for key, entry in self._index.items():  # noqa: B007 - the key found is deleted below
            if entry.children == 0 and self.pool.holders(entry.block_id) == {INDEX_HOLDER: 1}:
                break
        else:
            return False
        del self._index[key]
        if entry.parent is not None and entry.parent in self._index:
            self._index[entry.parent].children -= 1
        self.pool.decref(entry.block_id, INDEX_HOLDER)
        self.counters.evictions += 1
        self._dropped(key)
        return True

    def _dropped(self, key: int) -> None:
        callback = self.on_block_dropped
        if callback is None:
            return
        try:
            callback(key)
        except Exception as exc:  # noqa: BLE001 - a listener's bug must not break the cache
            log.error("mlx-recovery mock: on_block_dropped callback failed: %r", exc)
