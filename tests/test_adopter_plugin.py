"""AdopterPlugin through the hook: settings, clone-and-pin, trim-in-place, every refusal
counted with the entry left untouched, faults returning every reference, status."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlx_recovery_plugin.adopter.plugin import AdopterPlugin
from mlx_recovery_plugin.events import PrefixLookup
from mlx_recovery_plugin.plugins import HookEmitter, make_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.block_pool import BlockPool
from mlx_recovery_plugin.testing.detached_store import DetachedSet, DetachedStore

B = 16
LONG = list(range(1, 101))  # a 100-token stored entry: 6 whole blocks + a 4-token tail


def _settings(**kw: object) -> RecoverySettings:
    return RecoverySettings(adopter_enabled=True, **kw)  # type: ignore[arg-type]


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=64, block_size=B)


MakeStore = Callable[..., tuple[DetachedStore, AdopterPlugin]]


@pytest.fixture
def make_store(pool: BlockPool) -> MakeStore:
    def make(settings: RecoverySettings | None = None, **plugin_kw: object) -> tuple[DetachedStore, AdopterPlugin]:
        plugin = AdopterPlugin(settings=settings or _settings(), **plugin_kw)  # type: ignore[arg-type]
        pm = make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False)
        return DetachedStore(pool, pm=pm), plugin

    return make


def _snapshot(pool: BlockPool) -> dict[str, dict[int, int]]:
    return {h: dict(c) for h, c in pool.outstanding(ignore=()).items()}


def _sibling(matched: int, extra: int = 20) -> list[int]:
    return [*LONG[:matched], *range(1000, 1000 + extra)]


# -- construction and settings -------------------------------------------------------
def test_constructs_with_no_arguments_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_ADOPTER_ENABLED", "1")
    monkeypatch.setenv("MLX_RECOVERY_ADOPTER_MODE", "trim")
    monkeypatch.setenv("MLX_RECOVERY_ADOPTER_MIN_PREFIX_TOKENS", "64")
    status = AdopterPlugin().status()
    assert (status["enabled"], status["mode"], status["min_prefix_tokens"]) == (True, "trim", 64)


def test_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ENABLED", "MODE", "MIN_PREFIX_TOKENS"):
        monkeypatch.delenv(f"MLX_RECOVERY_ADOPTER_{name}", raising=False)
    assert AdopterPlugin().status()["enabled"] is False


def test_loads_through_its_entry_point() -> None:
    pm = make_plugin_manager(settings=RecoverySettings(plugins="adopter"))
    assert pm.load_report.loaded == ["adopter"]
    assert isinstance(pm.get_plugin("adopter"), AdopterPlugin)


def test_rejects_an_out_of_range_trim_keep_fraction() -> None:
    with pytest.raises(ValueError, match="trim_keep_fraction"):
        AdopterPlugin(settings=_settings(), trim_keep_fraction=1.5)


# -- disabled, whole, partial --------------------------------------------------------
def test_disabled_leaves_the_plain_path_which_declines_partial_matches(
    make_store: MakeStore, pool: BlockPool
) -> None:
    store, plugin = make_store(RecoverySettings(adopter_enabled=False))
    store.store(LONG)
    admission = store.admit("r", _sibling(60))
    assert (admission.cached_tokens, admission.reason) == (0, "declined_partial")
    assert plugin.status()["lookups"] == 0


def test_whole_entry_match_is_identical_to_the_plain_path(make_store: MakeStore, pool: BlockPool) -> None:
    prompt = [*LONG, 7, 7, 7]
    plain_store = DetachedStore(BlockPool(64, B))
    plain_store.store(LONG)
    plain = plain_store.admit("r", prompt)
    store, plugin = make_store()
    store.store(LONG)
    adopted = store.admit("r", prompt)
    assert (adopted.cached_tokens, adopted.reason) == (plain.cached_tokens, plain.reason) == (100, "whole")
    assert adopted.handle is not None and plain.handle is not None
    assert adopted.handle.tokens == plain.handle.tokens
    assert adopted.handle.block_ids == plain.handle.block_ids
    assert plugin.status()["reasons"] == {"whole": 1}


def test_partial_match_is_cloned_floored_and_the_entry_stays_whole(
    make_store: MakeStore, pool: BlockPool
) -> None:
    store, plugin = make_store()
    entry = store.store(LONG)
    admission = store.admit("r", _sibling(60))
    assert (admission.cached_tokens, admission.reason) == (48, "partial")
    handle = admission.handle
    assert handle is not None and handle.block_ids == entry.block_ids[:3] and handle.length == 48
    assert entry.length == 100 and entry.indexed and len(entry.block_ids) == 7
    status = plugin.status()
    assert status["adopted_tokens"] == 48 and status["adoptions"] == 1
    store.release(handle)
    store.evict(entry)
    assert pool.outstanding(ignore=()) == {}


def test_failed_pin_rolls_back_counts_pin_failed_and_goes_cold(
    make_store: MakeStore, pool: BlockPool
) -> None:
    store, plugin = make_store()
    entry = store.store(LONG)
    before = _snapshot(pool)
    store.fail_pin_on = lambda block_id: block_id == entry.block_ids[1]
    admission = store.admit("r", _sibling(60))
    assert (admission.cached_tokens, admission.handle, admission.reason) == (0, None, "pin_failed")
    assert _snapshot(pool) == before
    assert plugin.status()["reasons"] == {"pin_failed": 1}


# -- trim mode ----------------------------------------------------------------------
def test_trim_mode_takes_and_cuts_releasing_dropped_blocks_fully(
    make_store: MakeStore, pool: BlockPool
) -> None:
    store, _ = make_store(_settings(adopter_mode="trim"))
    entry = store.store(LONG)
    dropped = entry.block_ids[4:]
    admission = store.admit("r", _sibling(70))
    assert (admission.cached_tokens, admission.reason) == (64, "partial")
    assert admission.handle is entry and not entry.indexed and store.entries() == []
    assert entry.length == 64 and entry.layer_offsets == [64]
    assert all(pool.is_free(b) for b in dropped)
    store.release(admission.handle)
    assert pool.outstanding(ignore=()) == {}


def test_trim_mode_whole_match_takes_without_cutting(make_store: MakeStore) -> None:
    store, _ = make_store(_settings(adopter_mode="trim"))
    entry = store.store(LONG)
    admission = store.admit("r", [*LONG, 5])
    assert admission.handle is entry and entry.length == 100 and admission.reason == "whole"


def test_trim_release_errors_are_counted_everything_returned_and_request_goes_cold(
    make_store: MakeStore, pool: BlockPool
) -> None:
    store, plugin = make_store(_settings(adopter_mode="trim"))
    entry = store.store(LONG)
    pool.decref(entry.block_ids[6], entry.pin_holder)  # a foreign double release
    admission = store.admit("r", _sibling(70))
    assert (admission.cached_tokens, admission.handle, admission.reason) == (0, None, "release_error")
    assert pool.outstanding(ignore=()) == {} and pool.used_blocks == 0
    assert plugin.status()["reasons"] == {"release_error": 1}


# -- refusals: counted, entry untouched ---------------------------------------------
REFUSALS = [
    ("below_block_floor", {}, 10),
    ("side_data", {"side_data": {5: "turbo sidecar"}}, 60),
    ("sliding_window", {"logical_start": 32}, 60),
    ("no_recurrent_snapshot", {"recurrent": True, "snapshot_boundaries": [32, 100]}, 60),
]


@pytest.mark.parametrize(("reason", "layout", "matched"), REFUSALS, ids=[r[0] for r in REFUSALS])
@pytest.mark.parametrize("mode", ["clone", "trim"])
def test_refusals_are_counted_and_leave_the_entry_untouched(
    make_store: MakeStore, pool: BlockPool, reason: str, layout: dict, matched: int, mode: str
) -> None:
    store, plugin = make_store(_settings(adopter_mode=mode))
    entry = store.store(LONG, **layout)
    before = (_snapshot(pool), list(entry.block_ids), entry.tokens, entry.indexed)
    admission = store.admit("r", _sibling(matched))
    assert (admission.cached_tokens, admission.handle, admission.reason) == (0, None, reason)
    assert (_snapshot(pool), entry.block_ids, entry.tokens, entry.indexed) == before
    assert plugin.status()["reasons"] == {reason: 1}


def test_an_entry_released_between_lookup_and_decision_is_refused(
    make_store: MakeStore, pool: BlockPool
) -> None:
    store, plugin = make_store()
    entry = store.store(LONG)
    store.evict(entry)
    lookup = PrefixLookup("engine-0", "r", entry.set_id, 100, 60, B, entry=entry, store=store)
    decision = plugin.prefix_lookup(lookup)
    assert decision is not None and (decision.adopt_tokens, decision.reason) == (0, "pins_not_owned")
    assert pool.outstanding(ignore=()) == {}


def test_a_block_size_disagreeing_with_the_store_is_refused(make_store: MakeStore) -> None:
    store, plugin = make_store()
    entry = store.store(LONG)
    lookup = PrefixLookup("engine-0", "r", entry.set_id, 100, 60, 8, entry=entry, store=store)
    assert plugin.prefix_lookup(lookup).reason == "invalid_lookup"  # type: ignore[union-attr]


def test_a_lookup_without_a_store_is_left_to_the_host() -> None:
    plugin = AdopterPlugin(settings=_settings())
    assert plugin.prefix_lookup(PrefixLookup("e", "r", "x", 100, 60, B)) is None
    assert plugin.status()["reasons"] == {"no_store": 1}


class _BrokenStore(DetachedStore):
    def describe(self, entry: object):  # type: ignore[override]
        raise RuntimeError("host bug")


def test_a_store_that_raises_costs_reuse_not_the_step(pool: BlockPool) -> None:
    plugin = AdopterPlugin(settings=_settings())
    pm = make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False)
    store = _BrokenStore(pool, pm=pm)
    store.store(LONG)
    admission = store.admit("r", _sibling(60))
    assert (admission.cached_tokens, admission.reason) == (0, "store_error")
    assert HookEmitter(pm).errors == 0


def test_status_counts_every_reason_and_adopted_tokens(make_store: MakeStore) -> None:
    store, plugin = make_store(_settings(adopter_min_prefix_tokens=32))
    store.store(LONG)
    handles: list[DetachedSet] = []
    for i, matched in enumerate([60, 40, 20, 100]):
        admission = store.admit(f"r{i}", _sibling(matched) if matched < 100 else [*LONG, 1])
        if admission.handle is not None:
            handles.append(admission.handle)
    assert plugin.status() == {
        "enabled": True,
        "mode": "clone",
        "min_prefix_tokens": 32,
        "lookups": 4,
        "adoptions": 3,
        "adopted_tokens": 48 + 32 + 100,
        "reasons": {"below_block_floor": 1, "partial": 2, "whole": 1},
    }
    for handle in handles:
        store.release(handle)
