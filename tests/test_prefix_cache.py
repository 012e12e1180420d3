"""The mock host's prefix cache: whole blocks, chained keys, references, LRU eviction."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_recovery_plugin.ports import PrefixCachePort
from mlx_recovery_plugin.state import BlockState
from mlx_recovery_plugin.testing import BlockPool, PagedPrefixCache, chain_hash

B = 4


def _cache(blocks: int = 16, model_id: str = "m") -> PagedPrefixCache:
    return PagedPrefixCache(BlockPool(blocks, B), model_id)


def _blocks(first: int, end: int) -> list[BlockState]:
    return [BlockState(index=k, layers=()) for k in range(first, end)]


def _store(cache: PagedPrefixCache, tokens: Sequence[int], first: int = 0) -> int:
    whole = len(tokens) // B
    return cache.store("writer", tokens[: whole * B], _blocks(first, whole))


def test_conforms_to_the_prefix_cache_port() -> None:
    assert isinstance(_cache(), PrefixCachePort)


def test_empty_cache_fetch_restores_nothing_and_takes_nothing() -> None:
    cache = _cache()
    fetched = cache.fetch("req", list(range(10)))
    assert fetched.tokens == 0 and fetched.blocks == ()
    assert cache.pool.outstanding() == {}


def test_fetch_restores_the_longest_stored_whole_block_prefix() -> None:
    cache = _cache()
    tokens = list(range(12))
    assert _store(cache, tokens) == 12
    fetched = cache.fetch("req", tokens[:10] + [99, 98])
    assert fetched.tokens == 8
    assert [b.index for b in fetched.blocks] == [0, 1]
    cache.release("req")


def test_a_partial_block_is_never_stored() -> None:
    cache = _cache()
    tokens = list(range(10))
    assert cache.store("writer", tokens, _blocks(0, 2)) == 8
    assert len(cache) == 2
    assert cache.stored_tokens(tokens) == 8


def test_a_block_matches_only_after_the_same_earlier_blocks() -> None:
    cache = _cache()
    _store(cache, [1, 1, 1, 1, 2, 2, 2, 2])
    assert cache.stored_tokens([9, 9, 9, 9, 2, 2, 2, 2]) == 0
    assert cache.stored_tokens([1, 1, 1, 1, 2, 2, 2, 2]) == 8


def test_keys_differ_between_models() -> None:
    assert chain_hash("a", None, [1, 2]) != chain_hash("b", None, [1, 2])
    assert chain_hash("a", None, [1, 2]) == chain_hash("a", None, (1, 2))
    assert chain_hash("a", 5, [1, 2]) != chain_hash("a", None, [1, 2])


def test_fetch_references_are_held_until_release_and_release_is_idempotent() -> None:
    cache = _cache()
    tokens = list(range(8))
    _store(cache, tokens)
    cache.fetch("req", tokens)
    cache.fetch("req", tokens)
    held = cache.pool.outstanding()
    assert set(held) == {"req"} and sum(held["req"].values()) == 4
    cache.release("req")
    cache.release("req")
    cache.release("never-fetched")
    assert cache.pool.outstanding() == {}


def test_store_takes_no_reference_that_outlives_it() -> None:
    cache = _cache()
    _store(cache, list(range(16)))
    assert cache.pool.outstanding() == {}
    assert cache.pool.used_blocks == 4


def test_store_skips_blocks_already_stored() -> None:
    cache = _cache()
    tokens = list(range(16))
    _store(cache, tokens[:8])
    assert cache.counters.stores == 2
    assert _store(cache, tokens) == 16
    assert cache.counters.stores == 4
    assert cache.store("writer", tokens, _blocks(2, 4)) == 16
    assert cache.counters.stores == 4


def test_store_of_later_blocks_refuses_a_gap() -> None:
    cache = _cache()
    tokens = list(range(12))
    _store(cache, tokens[:4])
    assert cache.store("writer", tokens, _blocks(2, 3)) == 4
    assert len(cache) == 1


def test_store_of_later_blocks_extends_a_stored_prefix() -> None:
    cache = _cache()
    tokens = list(range(12))
    _store(cache, tokens[:8])
    assert cache.store("writer", tokens, _blocks(2, 3)) == 12
    assert [b.index for b in cache.fetch("r", tokens).blocks] == [0, 1, 2]
    cache.release("r")


def test_counters_count_fetches_hits_and_blocks() -> None:
    cache = _cache()
    tokens = list(range(8))
    _store(cache, tokens)
    cache.fetch("a", tokens)
    cache.fetch("b", [7] * 8)
    cache.release("a")
    assert (cache.counters.fetches, cache.counters.fetch_hits, cache.counters.hit_blocks) == (2, 1, 2)


def test_full_pool_evicts_the_least_recently_used_leaf() -> None:
    cache = _cache(blocks=4)
    old, recent = [1] * 8, [2] * 8
    _store(cache, old)
    _store(cache, recent)
    cache.fetch("reader", old)  # touches "old": now "recent" is the least recently used
    cache.release("reader")
    _store(cache, [3] * 4)
    assert cache.counters.evictions == 1
    assert cache.stored_tokens(old) == 8
    assert cache.stored_tokens(recent) == 4  # its leaf went, its first block stays


def test_a_referenced_block_is_never_evicted() -> None:
    cache = _cache(blocks=2)
    held = [1] * 8
    _store(cache, held)
    cache.fetch("reader", held)
    assert _store(cache, [5] * 4) == 0
    assert cache.stored_tokens(held) == 8
    cache.release("reader")
    assert _store(cache, [5] * 4) == 4


def test_the_chain_being_extended_is_not_evicted_for_its_own_next_block() -> None:
    cache = _cache(blocks=2)
    tokens = list(range(12))
    _store(cache, tokens[:8])
    # Room for block 2 could only come from evicting block 1, which it extends.
    assert cache.store("writer", tokens, _blocks(2, 3)) == 8
    assert cache.stored_tokens(tokens) == 8
    assert cache.pool.outstanding() == {}


def test_dropped_blocks_are_reported_to_a_chained_callback() -> None:
    cache = _cache(blocks=2)
    first: list[int] = []
    second: list[int] = []
    cache.on_block_dropped = first.append
    previous = cache.on_block_dropped

    def chained(key: int) -> None:
        second.append(key)
        previous(key)

    cache.on_block_dropped = chained
    _store(cache, [1] * 8)
    _store(cache, [2] * 4)
    assert first == second and len(first) == 1
    cache.clear()
    assert len(first) == 3  # one eviction, then the two blocks left


def test_a_failing_drop_callback_does_not_break_eviction() -> None:
    cache = _cache(blocks=1)

    def boom(key: int) -> None:
        raise RuntimeError("listener bug")

    cache.on_block_dropped = boom
    _store(cache, [1] * 4)
    assert _store(cache, [2] * 4) == 4


def test_clear_frees_blocks_once_their_readers_release() -> None:
    cache = _cache()
    tokens = list(range(8))
    _store(cache, tokens)
    cache.fetch("reader", tokens)
    cache.clear()
    assert len(cache) == 0 and cache.stored_tokens(tokens) == 0
    assert cache.pool.used_blocks == 2
    cache.release("reader")
    assert cache.pool.used_blocks == 0


_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "fetch", "release", "clear"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=14),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_any_sequence_of_calls_keeps_whole_blocks_and_leaks_nothing(ops: list) -> None:
    cache = _cache(blocks=6)
    for op, holder, tokens in ops:
        if op == "store":
            whole = len(tokens) // B
            done = cache.store(holder, tokens[: whole * B], _blocks(0, whole))
            assert done % B == 0 and done <= whole * B
        elif op == "fetch":
            fetched = cache.fetch(holder, tokens)
            assert fetched.tokens % B == 0 and fetched.tokens <= len(tokens)
            assert [b.index for b in fetched.blocks] == list(range(fetched.tokens // B))
        elif op == "release":
            cache.release(holder)
        else:
            cache.clear()
        assert set(cache.pool.outstanding()) <= {"a", "b", "c"}
    for holder in "abc":
        cache.release(holder)
    assert cache.pool.outstanding() == {}
    assert cache.pool.used_blocks == len(cache)
