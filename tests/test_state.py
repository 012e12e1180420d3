"""Cutting live mlx-lm caches into blocks and rebuilding caches from them."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlx_recovery_plugin.kvcodec import (
    UnsupportedCacheError,
    blocks_from_cache,
    cache_arrays,
    cache_from_blocks,
    cache_offset,
    kv_positions,
)
from mlx_recovery_plugin.state import BlockState, KVBlock, RecurrentSnapshot
from mlx_recovery_plugin.testing.caches import caches_equal

B = 16  # block size
HEADS, DIM = 2, 8


def kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return (
        mx.random.normal((1, HEADS, n, DIM), key=k1),
        mx.random.normal((1, HEADS, n, DIM), key=k2),
    )


def feed(cache: list, chunks: list[int], seed: int = 0) -> None:
    for i, n in enumerate(chunks):
        for j, layer in enumerate(cache):
            layer.update_and_fetch(*kv(n, seed * 1000 + i * 10 + j))
    mx.eval(cache_arrays(cache))


def test_kv_blocks_rebuild_a_cache_equal_to_the_live_one() -> None:
    live = [KVCache(), KVCache()]
    feed(live, [20, 37, 7])  # 64 tokens, writes that straddle block edges
    blocks = blocks_from_cache(live, 0, 4, B)
    rebuilt = cache_from_blocks(lambda: [KVCache(), KVCache()], blocks)
    assert cache_offset(rebuilt) == 64
    assert caches_equal(rebuilt, live)
    # The next write lands identically in both.
    new = kv(5, 99)
    a = live[0].update_and_fetch(*new)
    b = rebuilt[0].update_and_fetch(*new)
    assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()


def test_blocks_hold_their_own_bytes_and_keep_no_cache_buffer_alive() -> None:
    gc.collect()
    base = mx.get_active_memory()

    def cut() -> list[BlockState]:
        live = [KVCache()]
        feed(live, [8000])  # a 1 MiB key/value buffer
        blocks = blocks_from_cache(live, 2, 4, B)
        mx.eval([a for block in blocks for a in block.arrays()])
        return blocks

    blocks = cut()
    gc.collect()
    held = mx.get_active_memory() - base
    assert sum(block.nbytes for block in blocks) == 2 * 2 * HEADS * B * DIM * 4
    # Only the blocks' few KiB stay allocated, not the buffer they were cut from.
    assert held < 256 * 1024


def test_block_ranges_past_the_cache_are_refused() -> None:
    live = [KVCache()]
    feed(live, [40])
    with pytest.raises(ValueError):
        blocks_from_cache(live, 2, 3, B)


@pytest.mark.parametrize(
    ("max_size", "keep", "chunks"),
    [
        (64, 0, [32, 32]),  # never full
        (24, 0, [16] * 6),  # window smaller than two blocks
        (24, 4, [16] * 6),  # sink positions kept at the front
        (40, 4, [48, 16, 32]),  # updates longer than the window
    ],
)
@pytest.mark.parametrize("next_tokens", [1, 5])
def test_a_sliding_window_rebuilt_from_blocks_continues_exactly_like_the_live_one(
    max_size: int, keep: int, chunks: list[int], next_tokens: int
) -> None:
    live = RotatingKVCache(max_size, keep)
    blocks: list[BlockState] = []
    for i, n in enumerate(chunks):
        start = live.offset
        live.update_and_fetch(*kv(n, i))
        # Cut each block while its positions are still inside the window.
        for index in range(start // B, live.offset // B):
            keys, values = kv_positions(live, index * B, (index + 1) * B)
            blocks.append(BlockState(index, (KVBlock(keys, values),)))
    mx.eval(live.keys, live.values, [a for b in blocks for a in b.arrays()])

    rebuilt = cache_from_blocks(lambda: [RotatingKVCache(max_size, keep)], blocks)[0]
    assert caches_equal([rebuilt], [live])
    assert rebuilt.offset == live.offset
    for step in range(3):  # what attention sees on the next updates is identical
        new = kv(next_tokens, 100 + step)
        mask_live = live.make_mask(next_tokens, return_array=True)
        mask_rebuilt = rebuilt.make_mask(next_tokens, return_array=True)
        a_keys, a_values = live.update_and_fetch(*new)
        b_keys, b_values = rebuilt.update_and_fetch(*new)
        assert mx.array_equal(a_keys, b_keys).item()
        assert mx.array_equal(a_values, b_values).item()
        if mask_live is not None:
            assert mx.array_equal(mask_live, mask_rebuilt).item()


def test_positions_that_left_the_sliding_window_are_refused() -> None:
    live = RotatingKVCache(24, 0)
    live.update_and_fetch(*kv(64, 1))
    live.update_and_fetch(*kv(32, 2))
    with pytest.raises(ValueError, match="left the sliding window"):
        kv_positions(live, 0, B)
    keys, _ = kv_positions(live, 80, 96)  # the newest positions are still there
    assert keys.shape[2] == B


def test_recurrent_layers_restore_from_the_last_blocks_snapshot() -> None:
    def make() -> list:
        return [ArraysCache(2), KVCache()]

    live = make()
    snapshots = []
    for i in range(3):
        live[0][0] = mx.full((1, 3), float(i))
        live[0][1] = mx.full((1, 2, 2), float(-i))
        live[1].update_and_fetch(*kv(B, i))
        snapshots += blocks_from_cache(live, i, i + 1, B)
    assert isinstance(snapshots[2].layers[0], RecurrentSnapshot)
    rebuilt = cache_from_blocks(make, snapshots)
    assert caches_equal(rebuilt, live)
    assert rebuilt[0][0].tolist() == [[2.0, 2.0, 2.0]]


def test_recurrent_state_exists_only_at_the_cache_position() -> None:
    live = [ArraysCache(1), KVCache()]
    live[0][0] = mx.zeros((1, 2))
    live[1].update_and_fetch(*kv(2 * B, 0))
    with pytest.raises(ValueError, match="recurrent state exists only"):
        blocks_from_cache(live, 0, 2, B)
    assert len(blocks_from_cache(live, 1, 2, B)) == 1


def test_a_cache_of_recurrent_layers_only_needs_an_explicit_offset() -> None:
    live = [ArraysCache(1)]
    live[0][0] = mx.ones((1, 4))
    with pytest.raises(UnsupportedCacheError):
        blocks_from_cache(live, 0, 1, B)
    (block,) = blocks_from_cache(live, 0, 1, B, offset=B)
    assert isinstance(block.layers[0], RecurrentSnapshot)


def test_blocks_must_start_at_zero_and_match_the_model() -> None:
    live = [KVCache()]
    feed(live, [3 * B])
    blocks = blocks_from_cache(live, 0, 3, B)
    with pytest.raises(ValueError, match="contiguous"):
        cache_from_blocks(lambda: [KVCache()], blocks[1:])
    with pytest.raises(ValueError, match="layers"):
        cache_from_blocks(lambda: [KVCache(), KVCache()], blocks)
    assert cache_from_blocks(lambda: [KVCache()], [])[0].offset == 0


def test_cache_classes_that_cannot_be_cut_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedCacheError, match="QuantizedKVCache"):
        blocks_from_cache([QuantizedKVCache()], 0, 1, B, offset=B)
    with pytest.raises(UnsupportedCacheError, match="QuantizedKVCache"):
        cache_from_blocks(lambda: [QuantizedKVCache()], [])


def test_caches_equal_notices_one_changed_value_and_a_different_offset() -> None:
    a, b = [KVCache()], [KVCache()]
    feed(a, [B])
    feed(b, [B])
    assert caches_equal(a, b)
    b[0].keys[0, 0, 3, 0] = b[0].keys[0, 0, 3, 0] + 1.0
    assert not caches_equal(a, b)
    c = [KVCache()]
    feed(c, [B, 1])
    c[0].trim(1)
    assert caches_equal(a, c)  # what lies past the offset does not count
    c[0].offset -= 1
    assert not caches_equal(a, c)


def test_block_nbytes_counts_every_layer() -> None:
    block = BlockState(
        0,
        (
            KVBlock(mx.zeros((1, 2, B, 4)), mx.zeros((1, 2, B, 4))),
            RecurrentSnapshot((mx.zeros((1, 8)), None)),
        ),
        origin="recovery",
    )
    assert block.nbytes == 2 * (2 * B * 4 * 4) + 8 * 4
    assert len(block.arrays()) == 3
