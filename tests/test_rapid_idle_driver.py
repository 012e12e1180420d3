"""The rapid-mlx adapter's idle driver (no rapid-mlx needed): when it offers idle steps,
and that a delay answer wakes rapid-mlx's idle engine loop instead of leaving it to its
5 s timeout."""

from __future__ import annotations

import threading

from mlx_recovery_plugin.hosts.rapid.idle_driver import IdleDriver
from mlx_recovery_plugin.testing.clock import FakeClock


def test_offers_once_after_work_then_only_while_asked() -> None:
    driver = IdleDriver(FakeClock(10.0))
    assert not driver.wants_step()
    driver.note_work()
    assert driver.wants_step()
    driver.record_results([None, False])
    assert not driver.wants_step()
    driver.wake()
    driver.record_results([True, None])
    assert driver.wants_step()


def test_a_delay_answer_waits_on_the_injected_clock() -> None:
    clock = FakeClock(10.0)
    driver = IdleDriver(clock)
    driver.wake()
    driver.record_results([2.5, 7.0])
    assert not driver.wants_step()
    clock.advance(2.5)
    assert driver.wants_step()


def test_a_delay_answer_wakes_the_engine_loop_and_stop_cancels_it() -> None:
    woken = threading.Event()
    driver = IdleDriver(FakeClock(0.0))
    driver.waker = woken.set
    driver.wake()  # an immediate offer pokes the loop at once
    assert woken.wait(5.0)
    woken.clear()
    driver.record_results([0.01])
    assert woken.wait(5.0)  # the timer poked it; no timing asserted
    woken.clear()
    driver.record_results([30.0])
    driver.stop()
    assert not driver.wants_step()
    assert driver._timer is None  # cancelled, nothing left to fire


def test_a_failing_waker_is_swallowed() -> None:
    driver = IdleDriver(FakeClock(0.0))

    def closed_loop() -> None:
        raise RuntimeError("Event loop is closed")

    driver.waker = closed_loop
    driver.wake()  # no exception reaches the caller
    assert driver.wants_step()
