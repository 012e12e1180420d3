"""The host's door on a sparse rerun: what a token it read before costs there."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.recovery.costs import SparseSample
from mlx_recovery_plugin.recovery.door_reading import DoorReread, reread_share, rerun_door_seconds

# The real server's figures (oMLX, bench model): a first turn's 8,594 tokens scored in
# 3.4 s; the next turn's 11,278 tokens, 8,448 of them read before, in 2.2 s.
FRESH = 3.4 / 8594


def test_a_rerun_measures_the_share_a_token_read_before_costs_and_the_next_rerun_is_counted_with_it() -> None:
    share = reread_share(FRESH, 2.2, 11278, 2830)
    assert share == pytest.approx((2.2 - FRESH * 2830) / (FRESH * 8448))  # ~0.32
    assert 0.3 < share < 0.35
    # The turn after (2,683 new on 13,961): 2.7 s on the real server.
    assert rerun_door_seconds(FRESH, 2683, 11278, share) == pytest.approx(2.5, abs=0.2)
    # Counted as free, it would be the new tokens alone: 1.1 s.
    assert rerun_door_seconds(FRESH, 2683, 11278, 0.0) == pytest.approx(1.06, abs=0.05)


def test_a_share_is_kept_between_free_and_a_new_tokens_cost_and_a_first_turn_says_nothing() -> None:
    assert reread_share(FRESH, 0.5, 11278, 2830) == 0.0  # faster than its new tokens alone: noise
    assert reread_share(FRESH, 9.0, 11278, 2830) == 1.0  # slower than reading it all anew
    assert reread_share(FRESH, 3.4, 8594, 0) is None  # nothing grew: a first turn or a fork
    assert reread_share(0.0, 2.2, 11278, 2830) is None


def test_the_servers_share_is_the_median_of_its_recent_reruns_and_zero_before_any() -> None:
    reread = DoorReread(samples=3)
    assert reread.value == 0.0 and reread.measured == 0
    for share in (0.32, 0.9, 0.36, 0.40):  # the 0.32 falls out; 0.9 is one noisy turn
        reread.observe(share)
    reread.observe(None)
    assert reread.measured == 3 and reread.value == pytest.approx(0.40)


def test_a_sample_as_a_rerun_counts_the_door_at_the_first_turns_rate() -> None:
    first = SparseSample(8594, 6.4, door_s=3.4)
    # Without a learned share: the door for the new tokens only, as before.
    assert first.as_rerun(600).seconds == pytest.approx(6.4 - 3.4 + 3.4 * 600 / 8594)
    with_share = first.as_rerun(600, FRESH, 0.35)
    assert with_share.seconds == pytest.approx(6.4 - 3.4 + FRESH * (600 + 0.35 * 8594))
    # A rerun's own door already holds its re-reading: the next is counted from the
    # first turn's rate, not from the rerun's cheaper blend.
    rerun = SparseSample(11278, 6.0, door_s=2.2)
    assert rerun.as_rerun(2683, FRESH, 0.35).seconds > rerun.as_rerun(2683).seconds + 1.0
    assert SparseSample(8594, 6.4).as_rerun(600, FRESH, 0.35).seconds == 6.4  # no door: as measured
