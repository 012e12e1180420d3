"""Each prefill's share of the host's time (:class:`PrefillShares`), and the adapter's
record charging it: what the publish policy learns a turn's cost from when several
conversations prefill together. A fake clock throughout: nothing here sleeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlx_recovery_plugin.events import DepartureReason
from mlx_recovery_plugin.hosts.prefill_shares import PrefillShares, admission_shares
from mlx_recovery_plugin.hosts.records import EngineBook, EngineRecord, LiveRequest


def test_a_prefill_alone_is_charged_its_wall_time() -> None:
    shares = PrefillShares()
    began = shares.read(10.0, in_flight=0)
    assert shares.read(14.5, in_flight=1) - began == pytest.approx(4.5)


def test_prefills_side_by_side_split_the_time_they_shared() -> None:
    """A alone 0-2 s, with B 2-8 s, then B alone 8-9 s: A's share 2 + 3 = 5 s, B's 3 + 1
    = 4 s, and the two add up to the 9 s the host spent."""
    shares = PrefillShares()
    a = shares.read(0.0, in_flight=0)
    b = shares.read(2.0, in_flight=1)
    a_end = shares.read(8.0, in_flight=2)
    b_end = shares.read(9.0, in_flight=1)
    assert a_end - a == pytest.approx(5.0)
    assert b_end - b == pytest.approx(4.0)


def test_another_requests_door_is_charged_to_no_prefill() -> None:
    """oMLX scores a sparse prompt inside ``add_request`` on the step thread: the 3 s it
    took there did not advance the prefill in flight."""
    shares = PrefillShares()
    a = shares.read(0.0, in_flight=0)
    shares.skip(4.0, 7.0, in_flight=1)
    assert shares.read(10.0, in_flight=1) - a == pytest.approx(7.0)


def test_a_reading_earlier_than_the_last_moves_nothing() -> None:
    """A step's start is told after the step: a request admitted then counts from the
    last reading on, and no time is charged twice."""
    shares = PrefillShares()
    shares.read(5.0, in_flight=0)
    before = shares.read(4.0, in_flight=1)
    assert shares.read(6.0, in_flight=1) - before == pytest.approx(1.0)


def _record() -> EngineRecord:
    return EngineRecord(engine_id="e", port=SimpleNamespace(), driver=SimpleNamespace())


def test_the_record_charges_requests_admitted_together_each_their_share() -> None:
    """Three requests admitted at one step's start, whose prefills oMLX ran one after the
    other inside that step (30 s), all made their first token at its end: each is timed
    at 10 s, not 30, and the one the host spent 2 s on at its door (scoring a sparse
    prompt, restoring a cached prefix) adds them."""
    record = _record()
    lives = {rid: LiveRequest(in_scheduler=True, arrived_at=0.0) for rid in "abc"}
    lives["c"].door_s = 2.0
    with record.lock:
        record.live.update(lives)
        for live in lives.values():
            record.mark_admitted(live, 1.0)
        for live in lives.values():
            record.mark_first_token(live, 31.0)
    assert [lives[r].prefill_seconds() for r in "ab"] == [pytest.approx(10.0)] * 2
    assert lives["c"].prefill_seconds() == pytest.approx(12.0)


def test_a_dense_turn_over_a_restored_prefix_is_charged_the_restore_at_the_door() -> None:
    """oMLX fetches and rebuilds a cached prefix inside ``add_request``, before the
    request queues: a dense append over a published prefix costs the user that too, and
    the policy's measure of the host's dense append (its factor over the slices) must
    include it. Before, only a sparse prompt's door was counted."""
    now = [0.0]
    book = EngineBook(SimpleNamespace(request_departed=lambda event: None), clock=lambda: now[0])
    record = _record()
    live = LiveRequest(in_scheduler=True, arrived_at=0.0)
    with record.lock:
        record.live["d"] = live
    now[0] = 0.9
    book.note_door(record, "d", 0.9)
    with record.lock:
        record.mark_admitted(live, 1.0)
        record.mark_first_token(live, 5.0)
    assert live.prefill_seconds() == pytest.approx(0.9 + 4.0)


def test_a_request_gone_mid_prefill_stops_taking_a_share() -> None:
    """b departs at 4 s with its prefill unfinished: from there a has the host alone."""
    now = [0.0]
    book = EngineBook(SimpleNamespace(request_departed=lambda event: None), clock=lambda: now[0])
    record = _record()
    a, b = LiveRequest(in_scheduler=True), LiveRequest(in_scheduler=True)
    with record.lock:
        record.live.update(a=a, b=b)
        record.mark_admitted(a, 0.0)
        record.mark_admitted(b, 0.0)
    now[0] = 4.0
    book.depart(record, "b", DepartureReason.ABORTED)
    with record.lock:
        record.mark_first_token(a, 10.0)
    assert a.prefill_seconds() == pytest.approx(2.0 + 6.0)


def test_one_calls_prefills_in_turn_are_each_charged_their_own_part() -> None:
    """oMLX's stamps (its own clock, 100.0-103.0) say the short one ended 0.25 s into the
    call and the long one 2.75 s after that; the call took 6 s on the adapter's clock (a
    clock that ran twice as fast), so 0.5 s and 5.5 s, in the order the stamps came."""
    shares = admission_shares(6.0, 100.0, 103.0, [(103.0, 2400.0), (100.25, 150.0)])
    assert shares == pytest.approx([5.5, 0.5])
    assert sum(shares or []) == pytest.approx(6.0)


def test_a_chunked_prompts_first_chunk_after_the_last_stamp_is_its_own() -> None:
    """Chunked mode: the short prompt finished 0.5 s into the call, then the long one's
    first chunk ran to the call's end without a stamp: the rest of the call is its."""
    shares = admission_shares(3.0, 100.0, 103.0, [(100.5, 100.0), (None, 512.0)])
    assert shares == pytest.approx([0.5, 2.5])


def test_a_first_chunk_before_a_stamp_shares_that_stretch_by_tokens() -> None:
    """The long prompt's first chunk (512 tokens) ran before the short one (100) finished
    at 1.224 s: that stretch is split 512 : 100; the 1.776 s after the last stamp had no
    prefill left to run and goes to nobody."""
    shares = admission_shares(3.0, 100.0, 103.0, [(None, 512.0), (101.224, 100.0)])
    assert shares == pytest.approx([1.024, 0.2])


@pytest.mark.parametrize(
    "stamps",
    [[], [99.0, 101.0], [101.0, 104.5]],
    ids=["none", "stamp-before-the-call", "stamp-after-the-call"],
)
def test_stamps_outside_the_call_fall_back_to_an_even_split(stamps: list[float]) -> None:
    """A stamp from another clock or an earlier step says nothing of this call."""
    assert admission_shares(3.0, 100.0, 103.0, [(s, 1.0) for s in stamps]) is None


def test_a_call_of_no_length_on_the_hosts_clock_gives_no_parts() -> None:
    assert admission_shares(0.2, 100.0, 100.0, [(100.0, 1.0)]) is None
