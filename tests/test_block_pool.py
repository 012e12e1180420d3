"""The refcounted block pool: per-holder references, freeing, and leak reports."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.state import BlockState
from mlx_recovery_plugin.testing import BlockPool, BlockReferenceError, PoolExhaustedError


def _state(index: int = 0) -> BlockState:
    return BlockState(index=index, layers=())


def test_block_returns_to_free_list_only_when_last_holder_releases() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    block = pool.allocate("cache")
    pool.incref(block, "req-1")
    assert pool.refcount(block) == 2
    assert pool.decref(block, "cache") is False
    assert not pool.is_free(block)
    assert pool.decref(block, "req-1") is True
    assert pool.is_free(block)
    assert pool.used_blocks == 0


def test_freed_block_loses_its_data() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    block = pool.allocate("cache")
    pool.put(block, _state(), chain_hash=123)
    assert pool.get(block).index == 0 and pool.chain_hash(block) == 123
    pool.decref(block, "cache")
    with pytest.raises(BlockReferenceError):
        pool.get(block)
    assert pool.chain_hash(block) is None


def test_releasing_a_reference_never_taken_is_an_error() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    block = pool.allocate("cache")
    with pytest.raises(BlockReferenceError):
        pool.decref(block, "stranger")
    assert pool.holders(block) == {"cache": 1}


def test_referencing_a_free_block_is_an_error() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    with pytest.raises(BlockReferenceError):
        pool.incref(0, "req-1")


def test_exhausted_pool_refuses_allocation() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    pool.allocate("cache")
    assert not pool.can_allocate()
    with pytest.raises(PoolExhaustedError):
        pool.allocate("cache")


def test_outstanding_reports_every_holder_but_the_index() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    a, b = pool.allocate("cache"), pool.allocate("cache")
    pool.incref(a, "req-1")
    pool.incref(a, "req-1")
    pool.incref(b, "probe")
    out = pool.outstanding()
    assert out == {"req-1": {a: 2}, "probe": {b: 1}}
    assert pool.outstanding(ignore=())["cache"] == {a: 1, b: 1}
    pool.decref(a, "req-1")
    pool.decref(a, "req-1")
    pool.decref(b, "probe")
    assert pool.outstanding() == {}
