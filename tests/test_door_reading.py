"""The host's door on a sparse rerun: a new token costs more the more the door has read."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.recovery.costs import SparseSample
from mlx_recovery_plugin.recovery.door_reading import DoorGrowth, door_growth, rerun_door_seconds

# The real server's figures (oMLX's scoring log, the bench targets' 128x2 draft).
# Bench model: a first turn's 8,594 tokens scored in 3.4 s; the next, 2,830 new on 8,448
# read before, in 2.2 s; the one after, 2,697 new on 11,264, in 2.7 s.
BENCH_FRESH = 3.4 / 8594
# 2560x4 at 12k: 12,093 tokens in 6.1 s; then 665 new on 12,032 in 0.7 s, 757 new on
# 12,544 in 0.8 s.
WIDE_FRESH = 6.1 / 12093


def test_learned_at_one_growth_the_door_predicts_a_rerun_at_another() -> None:
    growth = door_growth(BENCH_FRESH, 2.2, 8448 + 2830, 2830)
    assert growth == pytest.approx((2.2 / (BENCH_FRESH * 2830) - 1) / 8448)  # ~1.1e-4
    assert rerun_door_seconds(BENCH_FRESH, 2697, 11264, growth) == pytest.approx(2.7, abs=0.3)
    # The other target's short turns, from the bench model's long ones: 0.8 s measured.
    assert rerun_door_seconds(WIDE_FRESH, 757, 12544, growth) == pytest.approx(0.8, abs=0.15)
    # Counted as free, the re-reading leaves the new tokens alone: 1.1 s for the 2.7.
    assert rerun_door_seconds(BENCH_FRESH, 2697, 11264, 0.0) == pytest.approx(1.07, abs=0.05)
    # And the other target's short turns measure about the same growth.
    assert door_growth(WIDE_FRESH, 0.7, 12032 + 665, 665) == pytest.approx(growth, rel=0.3)


def test_a_growth_is_never_negative_and_a_turn_that_did_not_grow_says_nothing() -> None:
    assert door_growth(BENCH_FRESH, 0.5, 11278, 2830) == 0.0  # faster than its new tokens alone: noise
    assert door_growth(BENCH_FRESH, 3.4, 8594, 0) is None  # nothing grew: a first turn or a fork
    assert door_growth(0.0, 2.2, 11278, 2830) is None
    assert door_growth(BENCH_FRESH, 2.2, 2830, 2830) is None  # nothing read before


def test_the_servers_growth_is_the_median_of_its_recent_reruns_and_zero_before_any() -> None:
    growth = DoorGrowth(samples=3)
    assert growth.value == 0.0 and growth.measured == 0
    for figure in (0.9e-4, 9e-4, 1.1e-4, 1.4e-4):  # the first falls out; 9e-4 is one noisy turn
        growth.observe(figure)
    growth.observe(None)
    assert growth.measured == 3 and growth.value == pytest.approx(1.4e-4)


def test_a_sample_as_a_rerun_counts_the_door_at_the_first_turns_rate() -> None:
    first = SparseSample(8594, 6.4, door_s=3.4)
    # Without a learned growth: the door for the new tokens only, as before.
    assert first.as_rerun(600).seconds == pytest.approx(6.4 - 3.4 + 3.4 * 600 / 8594)
    grown = first.as_rerun(600, BENCH_FRESH, 1.1e-4)
    assert grown.seconds == pytest.approx(6.4 - 3.4 + BENCH_FRESH * 600 * (1 + 1.1e-4 * 8594))
    # A rerun's own door already holds its re-reading: the next is counted from the
    # first turn's rate, not from the rerun's cheaper blend.
    rerun = SparseSample(11278, 6.0, door_s=2.2)
    assert rerun.as_rerun(2683, BENCH_FRESH, 1.1e-4).seconds > rerun.as_rerun(2683).seconds + 1.0
    assert SparseSample(8594, 6.4).as_rerun(600, BENCH_FRESH, 1.1e-4).seconds == 6.4  # no door: as measured
