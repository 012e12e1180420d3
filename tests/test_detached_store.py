"""The mock host's detached-set store: two references per block, clone-and-pin, trim,
release, and an entry lookup that, without the adopter, declines partial matches or (as
oMLX) restores their whole blocks."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.adopter.ports import (
    DetachedEntryStore,
    PinError,
    PinsNotOwnedError,
    ReleaseErrors,
)
from mlx_recovery_plugin.testing.block_pool import BlockPool, BlockReferenceError
from mlx_recovery_plugin.testing.detached_store import DetachedStore

B = 4


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=32, block_size=B)


@pytest.fixture
def store(pool: BlockPool) -> DetachedStore:
    return DetachedStore(pool)


def _all_refs(pool: BlockPool) -> dict[str, dict[int, int]]:
    return {h: dict(c) for h, c in pool.outstanding(ignore=()).items()}


def test_store_satisfies_the_adopter_protocol(store: DetachedStore) -> None:
    assert isinstance(store, DetachedEntryStore)


def test_every_stored_block_has_an_allocation_and_a_pin(store: DetachedStore, pool: BlockPool) -> None:
    entry = store.store(range(10))  # 2 whole blocks + a 2-token tail
    assert len(entry.block_ids) == 3
    for block_id in entry.block_ids:
        assert pool.holders(block_id) == {entry.alloc_holder: 1, entry.pin_holder: 1}


def test_plain_lookup_adopts_a_whole_entry_match(store: DetachedStore) -> None:
    store.store(range(10))
    admission = store.admit("r", [*range(10), 77, 78])
    assert admission.reason == "whole"
    assert admission.cached_tokens == 10
    assert admission.handle is not None and admission.handle.tokens == tuple(range(10))


def test_plain_lookup_declines_a_partial_match(store: DetachedStore, pool: BlockPool) -> None:
    entry = store.store(range(12))
    before = _all_refs(pool)
    admission = store.admit("r", [*range(9), 50, 51])
    assert (admission.cached_tokens, admission.handle, admission.reason) == (0, None, "declined_partial")
    assert admission.matched_tokens == 9 and admission.entry_id == entry.set_id
    assert _all_refs(pool) == before


def test_whole_block_lookup_restores_the_whole_blocks_of_a_partial_match(pool: BlockPool) -> None:
    store = DetachedStore(pool, partial="whole_blocks")
    entry = store.store(range(12))
    admission = store.admit("r", [*range(9), 50, 51])
    assert (admission.cached_tokens, admission.reason, admission.matched_tokens) == (8, "whole_blocks", 9)
    handle = admission.handle
    assert handle is not None and handle.tokens == tuple(range(8)) and handle.alloc_holder is None
    assert handle.block_ids == entry.block_ids[:2]  # the same physical blocks, pinned once more
    for block_id in handle.block_ids:
        assert pool.holders(block_id) == {entry.alloc_holder: 1, entry.pin_holder: 1, handle.pin_holder: 1}
    assert store.entries() == [entry] and entry.length == 12  # the entry stays whole
    store.release(handle)
    assert store.expected_refcounts() == {b: 2 for b in entry.block_ids}


def test_whole_block_lookup_declines_a_match_shorter_than_a_block(pool: BlockPool) -> None:
    store = DetachedStore(pool, partial="whole_blocks")
    store.store(range(12))
    before = _all_refs(pool)
    admission = store.admit("r", [0, 1, 2, 60, 61])
    assert (admission.cached_tokens, admission.handle, admission.reason) == (0, None, "below_block")
    assert _all_refs(pool) == before


def test_whole_block_lookup_still_adopts_a_whole_entry_match(pool: BlockPool) -> None:
    store = DetachedStore(pool, partial="whole_blocks")
    store.store(range(10))
    admission = store.admit("r", [*range(10), 77])
    assert (admission.cached_tokens, admission.reason) == (10, "whole")


def test_unknown_partial_policy_is_rejected(pool: BlockPool) -> None:
    with pytest.raises(ValueError, match="decline' or 'whole_blocks"):
        DetachedStore(pool, partial="trim_copy")  # type: ignore[arg-type]


def test_lookup_leaves_the_last_prompt_token_to_prefill(store: DetachedStore) -> None:
    store.store(range(8))
    entry, matched = store.match(range(8))
    assert entry is not None and matched == 7


def test_clone_pins_the_same_blocks_and_leaves_the_entry_whole(
    store: DetachedStore, pool: BlockPool
) -> None:
    entry = store.store(range(12))
    clone = store.clone_prefix(entry, 8, owner="r1")
    assert clone.block_ids == entry.block_ids[:2]
    assert clone.length == 8 and clone.layer_offsets == [8]
    for block_id in clone.block_ids:
        assert pool.holders(block_id)[clone.pin_holder] == 1
        assert pool.refcount(block_id) == 3
    assert entry.length == 12 and len(entry.block_ids) == 3 and entry.indexed


def test_clone_rolls_back_every_pin_when_one_fails(store: DetachedStore, pool: BlockPool) -> None:
    entry = store.store(range(16))
    before = _all_refs(pool)
    store.fail_pin_on = lambda block_id: block_id == entry.block_ids[2]
    with pytest.raises(PinError):
        store.clone_prefix(entry, 12, owner="r1")
    assert _all_refs(pool) == before
    assert len(store.live_sets()) == 1


@pytest.mark.parametrize("target", [6, 13, 0, -4])
def test_misaligned_and_oversized_targets_are_rejected(store: DetachedStore, pool: BlockPool, target: int) -> None:
    entry = store.store(range(12))
    before = _all_refs(pool)
    with pytest.raises(ValueError):
        store.clone_prefix(entry, target, owner="r")
    with pytest.raises(ValueError):
        store.trim(entry, target)
    assert _all_refs(pool) == before and entry.length == 12


def test_trim_target_must_be_block_aligned_even_at_the_entry_length(store: DetachedStore) -> None:
    taken = store.take(store.store(range(10)))
    with pytest.raises(ValueError):
        store.trim(taken, 10)
    assert taken.length == 10 and len(taken.block_ids) == 3


def test_trim_releases_both_references_of_dropped_blocks_and_clamps(
    store: DetachedStore, pool: BlockPool
) -> None:
    entry = store.store(range(14), num_layers=2)
    dropped = entry.block_ids[2:]
    taken = store.take(entry)
    store.trim(taken, 8)
    for block_id in dropped:
        assert pool.is_free(block_id)
    assert taken.length == 8 and taken.layer_offsets == [8, 8] and len(taken.block_ids) == 2
    for block_id in taken.block_ids:
        assert pool.holders(block_id) == {taken.alloc_holder: 1, taken.pin_holder: 1}


def test_trimming_an_indexed_entry_reindexes_it_at_the_new_length(store: DetachedStore) -> None:
    entry = store.store(range(12))
    store.trim(entry, 4)
    found, matched = store.match(range(20))
    assert found is entry and matched == 4


def test_trim_release_errors_are_reported_after_the_bookkeeping(
    store: DetachedStore, pool: BlockPool
) -> None:
    entry = store.store(range(16))
    taken = store.take(entry)
    # Someone else already gave back the pin of a block the trim will drop.
    pool.decref(taken.block_ids[3], taken.pin_holder)
    with pytest.raises(ReleaseErrors) as info:
        store.trim(taken, 8)
    assert len(info.value.errors) == 1
    assert isinstance(info.value.errors[0], BlockReferenceError)
    assert taken.length == 8 and len(taken.block_ids) == 2 and taken.layer_offsets == [8]
    store.release(taken)
    assert pool.outstanding(ignore=()) == {}


def test_trim_refuses_to_cut_side_data_sliding_windows_and_recurrent_gaps(store: DetachedStore) -> None:
    side = store.take(store.store(range(12), side_data={2: "sidecar"}))
    window = store.take(store.store(range(100, 112), logical_start=4))
    hybrid = store.take(store.store(range(200, 212), recurrent=True, snapshot_boundaries=[12]))
    for s in (side, window, hybrid):
        with pytest.raises(ValueError):
            store.trim(s, 8)
        assert s.length == 12 and len(s.block_ids) == 3


def test_take_is_one_shot(store: DetachedStore) -> None:
    entry = store.store(range(8))
    assert store.take(entry) is entry
    assert store.entries() == []
    with pytest.raises(PinsNotOwnedError):
        store.take(entry)


def test_release_is_idempotent_and_frees_everything(store: DetachedStore, pool: BlockPool) -> None:
    entry = store.store(range(12))
    clone = store.clone_prefix(entry, 8, owner="r")
    store.release(clone)
    store.release(clone)
    store.evict(entry)
    store.evict(entry)
    assert pool.outstanding(ignore=()) == {} and pool.used_blocks == 0
    with pytest.raises(PinsNotOwnedError):
        store.clone_prefix(entry, 4, owner="late")


def test_eviction_keeps_blocks_a_clone_still_pins(store: DetachedStore, pool: BlockPool) -> None:
    entry = store.store(range(12))
    clone = store.clone_prefix(entry, 8, owner="r")
    tail = entry.block_ids[2]
    store.evict(entry)
    assert pool.is_free(tail)
    for block_id in clone.block_ids:
        assert pool.holders(block_id) == {clone.pin_holder: 1}
    store.release(clone)
    assert pool.used_blocks == 0


def test_expected_refcounts_match_the_pool(store: DetachedStore, pool: BlockPool) -> None:
    a = store.store(range(12))
    store.clone_prefix(a, 8, owner="x")
    store.trim(store.take(store.store(range(50, 62))), 4)
    expected = store.expected_refcounts()
    assert {b: pool.refcount(b) for b in range(pool.num_blocks) if pool.refcount(b)} == expected
