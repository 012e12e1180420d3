"""Publication: whole blocks stored under the job's own prefix, committed only after the
host's own fetch path restores them, every probe reference given back on every path."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import pytest

from mlx_recovery_plugin.ports import FetchedPrefix
from mlx_recovery_plugin.recovery.publication import (
    ProbeFetchError,
    ProbeMismatch,
    StoreError,
    StoreRefused,
    fetched,
    probe_restorable,
    publish,
)
from mlx_recovery_plugin.state import BlockState, KVBlock
from mlx_recovery_plugin.testing.block_pool import BlockPool
from mlx_recovery_plugin.testing.prefix_cache import PagedPrefixCache

B = 8
TOKENS = tuple(range(1, 41))  # 5 whole blocks


def block(index: int, origin: str = "recovery", draft: bool = False) -> BlockState:
    kv = KVBlock(mx.full((1, 1, B, 2), float(index)), mx.full((1, 1, B, 2), -float(index)))
    return BlockState(index, (kv,), origin=origin, draft_state=draft)


@pytest.fixture
def cache() -> PagedPrefixCache:
    return PagedPrefixCache(BlockPool(num_blocks=16, block_size=B), model_id="m")


def no_refs(cache: PagedPrefixCache) -> bool:
    return cache.pool.outstanding() == {} and cache.holders == []


class Flaky:
    """The real cache with one method replaced by a failure."""

    def __init__(self, inner: PagedPrefixCache, *, store=None, fetch=None) -> None:
        self.inner = inner
        self._store = store
        self._fetch = fetch

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def fetch(self, holder_id: str, tokens: Sequence[int]) -> FetchedPrefix:
        if self._fetch is not None:
            return self._fetch(self.inner, holder_id, tokens)
        return self.inner.fetch(holder_id, tokens)

    def release(self, holder_id: str) -> None:
        self.inner.release(holder_id)

    def store(self, holder_id: str, tokens: Sequence[int], blocks: Sequence[BlockState]) -> int:
        if self._store is not None:
            return self._store(self.inner, holder_id, tokens, blocks)
        return self.inner.store(holder_id, tokens, blocks)


def test_published_blocks_are_restorable_and_the_probe_holds_nothing(cache) -> None:
    result = publish(cache, TOKENS, [block(0), block(1)], B, holder_id="job", probe_id="probe")
    assert result.boundary == 16 and result.restored_tokens == 16
    assert cache.stored_tokens(TOKENS) == 16
    assert no_refs(cache)
    result = publish(cache, TOKENS, [block(2), block(3), block(4)], B, holder_id="job", probe_id="probe")
    assert result.boundary == 40
    with fetched(cache, "reader", TOKENS) as prefix:
        assert prefix.tokens == 40
        assert [b.index for b in prefix.blocks] == [0, 1, 2, 3, 4]
    assert no_refs(cache)


def test_publication_stores_under_the_job_prefix_only(cache) -> None:
    publish(cache, TOKENS, [block(0), block(1)], B, holder_id="job", probe_id="probe")
    other = TOKENS[:8] + tuple(t + 100 for t in TOKENS[8:])
    assert cache.stored_tokens(other) == 8  # only the shared first block matches
    assert cache.stored_tokens(TOKENS[:16]) == 16


def test_published_blocks_are_marked_as_recovery_without_draft_state(cache) -> None:
    publish(cache, TOKENS, [block(0, origin="dense", draft=True)], B, holder_id="j", probe_id="p")
    with fetched(cache, "reader", TOKENS) as prefix:
        (only,) = prefix.blocks
        assert only.origin == "recovery" and only.draft_state is False


def test_store_error_is_raised_as_a_store_fault_and_leaves_no_references(cache) -> None:
    def boom(inner, holder, tokens, blocks):
        raise RuntimeError("disk full")

    with pytest.raises(StoreError) as info:
        publish(Flaky(cache, store=boom), TOKENS, [block(0)], B, holder_id="j", probe_id="p")
    assert info.value.kind == "store_error"
    assert no_refs(cache)


def test_store_that_keeps_less_than_published_is_refused(cache) -> None:
    # Block 1 without block 0 leaves a gap: the store keeps nothing.
    with pytest.raises(StoreRefused):
        publish(cache, TOKENS, [block(1)], B, holder_id="j", probe_id="p")
    assert cache.stored_tokens(TOKENS) == 0
    assert no_refs(cache)


def test_probe_restoring_less_than_published_is_a_mismatch_and_releases_the_probe(cache) -> None:
    def short_fetch(inner, holder, tokens):
        return inner.fetch(holder, tokens[: len(tokens) - B])

    with pytest.raises(ProbeMismatch) as info:
        publish(Flaky(cache, fetch=short_fetch), TOKENS, [block(0), block(1)], B, holder_id="j", probe_id="p")
    assert info.value.kind == "probe_mismatch"
    assert no_refs(cache)


def test_probe_fetch_error_after_taking_references_still_releases_them(cache) -> None:
    def fetch_then_fail(inner, holder, tokens):
        inner.fetch(holder, tokens)  # references taken, then the host fails
        raise RuntimeError("host lost its cache")

    with pytest.raises(ProbeFetchError) as info:
        publish(Flaky(cache, fetch=fetch_then_fail), TOKENS, [block(0)], B, holder_id="j", probe_id="p")
    assert info.value.kind == "fetch_error"
    assert no_refs(cache)


def test_probe_restorable_counts_and_releases(cache) -> None:
    publish(cache, TOKENS, [block(0), block(1), block(2)], B, holder_id="j", probe_id="p")
    assert probe_restorable(cache, "probe-2", TOKENS) == 24
    assert probe_restorable(cache, "probe-3", TOKENS[:20]) == 16
    assert no_refs(cache)


@pytest.mark.parametrize(
    "blocks, message",
    [([], "nothing"), ([0, 2], "contiguous"), ([4, 5], "past the job")],
)
def test_malformed_publication_is_refused_before_touching_the_host(cache, blocks, message) -> None:
    with pytest.raises(ValueError, match=message):
        publish(cache, TOKENS, [block(i) for i in blocks], B, holder_id="j", probe_id="p")
    assert len(cache) == 0 and no_refs(cache)
