"""The mock host's whole-entry prefix cache (rapid-mlx's kind): one entry per stored
sequence, found by its longest shared prefix, covering entries replace what they cover,
fetches pin until released, pinned entries survive eviction."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.ports import StoreUnit, WholeEntryCachePort, store_unit
from mlx_recovery_plugin.state import BlockState
from mlx_recovery_plugin.testing import PagedPrefixCache, WholeEntryPrefixCache
from mlx_recovery_plugin.testing.block_pool import BlockPool

B = 4


def _blocks(n: int) -> list[BlockState]:
    return [BlockState(index=k, layers=()) for k in range(n)]


def test_it_says_it_stores_whole_entries_and_the_paged_cache_says_blocks() -> None:
    entries = WholeEntryPrefixCache(B)
    assert isinstance(entries, WholeEntryCachePort)
    assert store_unit(entries) is StoreUnit.WHOLE_ENTRY
    assert store_unit(PagedPrefixCache(BlockPool(4, B), "m")) is StoreUnit.BLOCKS


def test_a_store_needs_every_block_of_the_prefix() -> None:
    cache = WholeEntryPrefixCache(B)
    tokens = list(range(3 * B))
    assert cache.store("w", tokens, _blocks(3)[1:]) == 0  # the trailing blocks alone: refused
    assert cache.store("w", tokens, _blocks(3)) == 3 * B


def test_a_lookup_restores_the_longest_shared_prefix_of_any_entry_in_whole_blocks() -> None:
    cache = WholeEntryPrefixCache(B)
    tokens = list(range(4 * B))
    cache.store("w", tokens, _blocks(4))
    longer = cache.fetch("r1", tokens + [99, 98])  # the entry is a prefix of the prompt
    shorter = cache.fetch("r2", tokens[: 2 * B + 1])  # the entry is longer: trimmed back
    diverging = cache.fetch("r3", tokens[: 3 * B - 1] + [7] * 9)  # shares 11 tokens: 2 blocks
    assert (longer.tokens, shorter.tokens, diverging.tokens) == (4 * B, 2 * B, 2 * B)
    assert [b.index for b in diverging.blocks] == [0, 1]
    assert sorted(cache.outstanding()) == ["r1", "r2", "r3"]
    for holder in ("r1", "r2", "r3", "r3"):
        cache.release(holder)  # idempotent
    assert cache.outstanding() == {}


def test_a_longer_entry_replaces_the_entries_it_covers_unless_someone_holds_them() -> None:
    cache = WholeEntryPrefixCache(B)
    tokens = list(range(6 * B))
    cache.store("w", tokens[: 2 * B], _blocks(2))
    cache.fetch("reader", tokens[: 2 * B])
    cache.store("w", tokens[: 4 * B], _blocks(4))
    assert len(cache) == 2  # the pinned 2-block entry stays
    cache.release("reader")
    cache.store("w", tokens, _blocks(6))
    assert len(cache) == 1  # both shorter entries went, now that nobody holds them
    assert cache.stored_tokens(tokens[: 2 * B]) == 2 * B  # the longer entry serves them


def test_eviction_takes_the_least_recently_used_unpinned_entry() -> None:
    cache = WholeEntryPrefixCache(B, max_entries=2)
    a, b, c = ([seed] * (2 * B) for seed in (1, 2, 3))
    cache.store("w", a, _blocks(2))
    cache.store("w", b, _blocks(2))
    cache.fetch("reader", a)  # a is pinned and most recently used
    cache.store("w", c, _blocks(2))
    assert (cache.stored_tokens(a), cache.stored_tokens(b), cache.stored_tokens(c)) == (2 * B, 0, 2 * B)
    cache.release("reader")


@pytest.mark.parametrize("size,entries", [(0, 1), (4, 0)])
def test_bad_sizes_are_refused(size: int, entries: int) -> None:
    with pytest.raises(ValueError):
        WholeEntryPrefixCache(size, max_entries=entries)
