"""The adopter's pure decision: whole, floored partial, and every refusal reason."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_recovery_plugin.adopter.decision import Reason, plan_adoption
from mlx_recovery_plugin.adopter.ports import EntryLayout
from mlx_recovery_plugin.settings import AdoptMode
from mlx_recovery_plugin.state import floor_block

B = 16


def _plan(entry: int, matched: int, **kw: object):
    layout_kw = {k: kw.pop(k) for k in list(kw) if k in EntryLayout.__dataclass_fields__}
    layout = EntryLayout(tokens=entry, block_size=B, **layout_kw)  # type: ignore[arg-type]
    return plan_adoption(entry_tokens=entry, matched_tokens=matched, layout=layout, **kw)  # type: ignore[arg-type]


def test_whole_entry_match_adopts_the_entry_unchanged_even_off_block() -> None:
    plan = _plan(52, 52)
    assert (plan.adopt_tokens, plan.reason, plan.cut) == (52, Reason.WHOLE, False)


def test_partial_match_is_floored_to_the_block() -> None:
    plan = _plan(52, 47)
    assert (plan.adopt_tokens, plan.reason, plan.cut) == (32, Reason.PARTIAL, True)


def test_partial_match_on_a_block_boundary_keeps_it() -> None:
    assert _plan(100, 48).adopt_tokens == 48


@pytest.mark.parametrize("matched", [0, 1, 15])
def test_match_shorter_than_a_block_is_below_the_block_floor(matched: int) -> None:
    plan = _plan(64, matched)
    assert (plan.adopt_tokens, plan.reason) == (0, Reason.BELOW_BLOCK_FLOOR)


def test_min_prefix_tokens_raises_the_floor() -> None:
    assert _plan(200, 70, min_prefix_tokens=80).reason is Reason.BELOW_BLOCK_FLOOR
    assert _plan(200, 70, min_prefix_tokens=64).adopt_tokens == 64


def test_side_data_on_a_dropped_block_is_refused_but_on_a_kept_block_is_fine() -> None:
    assert _plan(64, 40, side_data_blocks=frozenset({3})).reason is Reason.SIDE_DATA
    assert _plan(64, 40, side_data_blocks=frozenset({0, 1})).reason is Reason.PARTIAL


def test_sliding_window_not_starting_at_zero_is_refused() -> None:
    assert _plan(64, 40, logical_start=8).reason is Reason.SLIDING_WINDOW


def test_recurrent_state_needs_a_snapshot_at_the_floored_boundary() -> None:
    assert _plan(64, 40, recurrent=True, snapshot_boundaries=frozenset({64})).reason is (
        Reason.NO_RECURRENT_SNAPSHOT
    )
    assert _plan(64, 40, recurrent=True, snapshot_boundaries=frozenset({32, 64})).adopt_tokens == 32


def test_cutting_refusals_do_not_apply_to_a_whole_entry_match() -> None:
    plan = _plan(64, 64, side_data_blocks=frozenset({3}), logical_start=8, recurrent=True)
    assert plan.reason is Reason.WHOLE


def test_a_set_that_no_longer_owns_its_pins_is_refused_even_whole() -> None:
    assert _plan(64, 64, owns_pins=False).reason is Reason.PINS_NOT_OWNED


def test_trim_mode_refuses_a_cut_that_would_gut_a_long_entry() -> None:
    assert _plan(1024, 40, mode=AdoptMode.TRIM).reason is Reason.TRIM_WOULD_GUT
    assert _plan(1024, 40, mode=AdoptMode.CLONE).adopt_tokens == 32
    assert _plan(1024, 40, mode=AdoptMode.TRIM, trim_keep_fraction=0.0).adopt_tokens == 32
    assert _plan(64, 40, mode=AdoptMode.TRIM).adopt_tokens == 32


@pytest.mark.parametrize(("entry", "matched"), [(64, 65), (64, -1)])
def test_inconsistent_lookups_are_refused(entry: int, matched: int) -> None:
    assert _plan(entry, matched).reason is Reason.INVALID_LOOKUP


def test_layout_disagreeing_with_the_lookup_is_refused() -> None:
    layout = EntryLayout(tokens=48, block_size=B)
    plan = plan_adoption(entry_tokens=64, matched_tokens=40, layout=layout)
    assert plan.reason is Reason.INVALID_LOOKUP


@settings(max_examples=50, deadline=None)
@given(entry=st.integers(1, 500), data=st.data(), block=st.sampled_from([1, 4, 16, 256]))
def test_adopted_tokens_never_exceed_the_match_and_cuts_are_block_aligned(
    entry: int, data: st.DataObject, block: int
) -> None:
    matched = data.draw(st.integers(0, entry))
    layout = EntryLayout(tokens=entry, block_size=block)
    plan = plan_adoption(entry_tokens=entry, matched_tokens=matched, layout=layout)
    assert plan.adopt_tokens <= matched
    if plan.cut:
        assert plan.adopt_tokens % block == 0 and plan.adopt_tokens == floor_block(matched, block)
    if plan.adopted and not plan.cut:
        assert plan.adopt_tokens == entry == matched
