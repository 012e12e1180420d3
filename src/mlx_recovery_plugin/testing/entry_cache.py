"""The mock host's other kind of prefix cache: whole entries, as rapid-mlx keeps them.

One entry per stored token sequence holds the state of all of it (here: its whole blocks,
in order). A lookup finds the entry that shares the longest prefix with the prompt: an
entry equal to the prompt, a prefix of it, or a longer or diverging entry, which is
trimmed back to the shared prefix (rapid-mlx's exact / prefix / supersequence / LCP
matches, for caches that can rewind). Storing a sequence drops the stored entries that
are strict prefixes of it, as rapid-mlx's ``store(..., evict_prefixes=True)`` does, and
the least recently used entries go first when more than ``max_entries`` are kept.

rapid-mlx's lookup takes no reference (it hands out copies); this mock is stricter and
pins the entry a fetch used under the fetcher's id until :meth:`release`, so a test can
prove every fetch was given back. A pinned entry is never evicted.

Implements :class:`mlx_recovery_plugin.ports.WholeEntryCachePort`. Owned by the engine
thread; not thread-safe by design.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..ports import FetchedPrefix, StoreUnit
from ..state import BlockState
from .prefix_cache import CacheCounters

log = logging.getLogger(__name__)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    blocks: tuple[BlockState, ...]


class WholeEntryPrefixCache:
    """Whole-entry prefix cache of one model, at most ``max_entries`` entries."""

    store_unit = StoreUnit.WHOLE_ENTRY

    def __init__(self, block_size: int, max_entries: int = 64) -> None:
        if block_size <= 0 or max_entries <= 0:
            raise ValueError("block_size and max_entries must be > 0")
        self._block_size = block_size
        self.max_entries = max_entries
        self.counters = CacheCounters()
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # LRU, oldest first
        self._pins: dict[str, Counter[tuple[int, ...]]] = {}

    # -- the port -------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block_size

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        """The longest whole-block prefix of ``tokens`` any entry restores; the entry is
        pinned under ``holder_id`` until :meth:`release`."""
        self.counters.fetches += 1
        entry, whole = self._best(tokens)
        if entry is None or whole == 0:
            return FetchedPrefix(tokens=0)
        self._entries.move_to_end(entry.tokens)
        self._pins.setdefault(holder_id, Counter())[entry.tokens] += 1
        self.counters.fetch_hits += 1
        self.counters.hit_blocks += whole
        return FetchedPrefix(tokens=whole * self._block_size, blocks=entry.blocks[:whole])

    def release(self, holder_id: str) -> None:
        """Unpin what ``holder_id`` fetched. Idempotent."""
        self._pins.pop(holder_id, None)

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[BlockState]) -> int:
        """Store one entry for the whole blocks of ``tokens``; ``blocks`` must be all of
        them, from block 0. Returns how many leading tokens of ``tokens`` a lookup
        restores afterwards."""
        size = self._block_size
        whole = len(tokens) // size
        key = tuple(tokens[: whole * size])
        if whole == 0:
            return 0
        if len(blocks) != whole or [b.index for b in blocks] != list(range(whole)):
            log.warning(
                "mlx-recovery mock: store by %r refused: a whole entry needs blocks 0..%d, got %s",
                holder_id, whole - 1, [b.index for b in blocks],
            )
            return self.stored_tokens(key)
        if key not in self._entries:
            for old in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                if not self._pinned(old):
                    del self._entries[old]
            self._entries[key] = _Entry(key, tuple(blocks))
            self.counters.stores += whole
            while len(self._entries) > self.max_entries and self._evict_one():
                pass
        self._entries.move_to_end(key)
        return self.stored_tokens(key)

    # -- host-side operations ---------------------------------------------------------
    def stored_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` a fetch would restore (takes nothing)."""
        _, whole = self._best(tokens)
        return whole * self._block_size

    def clear(self) -> None:
        """Drop every entry (a deep reset, or rapid-mlx's idle cache clear)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def holders(self) -> list[str]:
        """Holders with fetches not yet released."""
        return list(self._pins)

    def outstanding(self) -> dict[str, Counter[tuple[int, ...]]]:
        """Holder -> pinned entries (empty when every fetch was released)."""
        return {holder: Counter(pins) for holder, pins in self._pins.items()}

    # -- private ------------------------------------------------------------------
    def _best(self, tokens: Sequence[int]) -> tuple[_Entry | None, int]:
        best: _Entry | None = None
        best_whole = 0
        for entry in self._entries.values():
            whole = _shared(entry.tokens, tokens) // self._block_size
            if whole > best_whole:
                best, best_whole = entry, whole
        return best, best_whole

    def _pinned(self, key: tuple[int, ...]) -> bool:
        return any(pins[key] for pins in self._pins.values())

    def _evict_one(self) -> bool:
        for key in self._entries:
            if not self._pinned(key):
                del self._entries[key]
                self.counters.evictions += 1
                return True
        return False
