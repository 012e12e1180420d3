"""When conversations are expected back, and the job order that follows from it."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.recovery.jobs import RecoveryJob
from mlx_recovery_plugin.recovery.returns import SEEN_GAPS, ReturnTimes, due_first


def test_a_conversation_is_due_back_the_median_gap_after_its_last_turn() -> None:
    times = ReturnTimes()
    times.turn(1, 100.0)
    assert times.due(1) is None  # no gap seen yet
    times.turn(1, 130.0)  # 30 s
    times.turn(2, 135.0)
    times.turn(2, 185.0)  # 50 s
    times.turn(3, 190.0)
    times.turn(3, 230.0)  # 40 s
    assert times.expected_gap() == pytest.approx(40.0)
    assert times.due(1) == pytest.approx(170.0)
    assert times.due(3) == pytest.approx(270.0)
    assert times.due(4) is None  # never served here


def test_a_request_told_twice_is_one_turn() -> None:
    times = ReturnTimes()
    times.turn(1, 100.0, "r1")
    times.turn(1, 140.0, "r2")
    times.turn(1, 140.2, "r2")  # the same request, told again with its door's share
    assert times.expected_gap() == pytest.approx(40.0)
    assert times.due(1) == pytest.approx(180.0)


def test_only_the_latest_gaps_count_and_a_forgotten_job_is_due_never() -> None:
    times = ReturnTimes()
    for i in range(SEEN_GAPS + 1):
        times.turn(i, 0.0)
        times.turn(i, 100.0 if i == 0 else 10.0)
    assert times.expected_gap() == pytest.approx(10.0)
    times.keep_only([1])
    assert times.due(1) == pytest.approx(20.0) and times.due(2) is None


def _job(job_id: int) -> RecoveryJob:
    return RecoveryJob(job_id=job_id, tokens=tuple(range(512)), target_end=512)


def test_the_job_due_first_that_still_fits_goes_first() -> None:
    """A is due in 1 s but needs 2; C is due in 5 s and needs 2: C. B (due in 30 s) would
    fit too, later."""
    a, b, c = _job(1), _job(2), _job(3)
    due = {1: 101.0, 2: 130.0, 3: 105.0}
    chosen = due_first([b, a, c], now=100.0, due=lambda j: due[j.job_id], work_s=lambda j: 2.0)
    assert chosen is c


def test_without_a_due_time_or_a_cost_or_a_job_that_fits_there_is_no_choice() -> None:
    a, b = _job(1), _job(2)
    assert due_first([a, b], now=0.0, due=lambda j: None, work_s=lambda j: 1.0) is None
    assert due_first([a, b], now=0.0, due=lambda j: 10.0, work_s=lambda j: None) is None
    assert due_first([a, b], now=0.0, due=lambda j: 10.0, work_s=lambda j: 11.0) is None
