"""Idle driving: an idle oMLX engine steps only while a plugin asks, on its own executor
thread and MLX stream, and never while it has real work."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

omlx = pytest.importorskip(
    "omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests"
)

from mlx_recovery_plugin.events import IdleStep
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.hosts.omlx.idle_driver import IdleDriver
from mlx_recovery_plugin.testing.clock import FakeClock
from mlx_recovery_plugin.testing.contract import EventRecorder, contract_tokens
from mlx_recovery_plugin.testing.omlx_host import OmlxContractHost
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model

# -- the driver alone ------------------------------------------------------------------


def test_driver_offers_once_after_work_then_only_while_asked() -> None:
    driver = IdleDriver(FakeClock(100.0))
    assert not driver.wants_step()
    driver.note_work()
    assert driver.wants_step()
    driver.record_results([None, True])
    assert driver.wants_step()
    driver.record_results([None, False])
    assert not driver.wants_step()


def test_driver_waits_for_the_shortest_delay_asked() -> None:
    clock = FakeClock(100.0)
    driver = IdleDriver(clock)
    driver.wake()
    driver.record_results([5.0, 2.0, None])
    assert not driver.wants_step()
    clock.now += 1.9
    assert not driver.wants_step()
    clock.now += 0.2
    assert driver.wants_step()
    assert driver.snapshot()["wait_s"] == 0.0


@pytest.mark.parametrize("answer", [0.0, -1.0, float("nan"), float("inf"), "soon", 1])
def test_driver_ignores_answers_that_are_not_a_positive_finite_delay(answer: Any) -> None:
    clock = FakeClock(100.0)
    driver = IdleDriver(clock)
    driver.wake()
    driver.record_results([answer])
    clock.now += 10.0
    # An int is a delay too (True is not: it means "now").
    assert driver.wants_step() is (answer == 1)


def test_a_stopped_driver_offers_nothing_until_resumed() -> None:
    driver = IdleDriver(FakeClock(100.0))
    driver.wake()
    driver.stop()
    driver.wake()
    assert not driver.wants_step()
    driver.resume()
    driver.wake()
    assert driver.wants_step()


def test_a_failing_idle_step_ends_the_offers() -> None:
    driver = IdleDriver(FakeClock(100.0))
    driver.wake()

    def emit(event: IdleStep) -> list[Any]:
        raise RuntimeError("broken emitter")

    driver.run_idle_step("e", None, emit)
    assert not driver.wants_step() and driver.offered == 1


# -- on a real engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_llama_dir)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


@pytest.fixture
def recorder() -> EventRecorder:
    return EventRecorder()


@pytest.fixture
def host(models: tuple[Any, Any], clock: FakeClock, recorder: EventRecorder) -> Iterator[OmlxContractHost]:
    model, tokenizer = models
    h = OmlxContractHost(model, tokenizer, plugins=[recorder], clock=clock)
    yield h
    h.close()


def test_a_delay_answer_resumes_offers_only_once_the_delay_has_passed(
    host: OmlxContractHost, recorder: EventRecorder, clock: FakeClock
) -> None:
    recorder.idle_answer = lambda step: 30.0 if step.consecutive == 1 else None
    assert host.drive_idle(max_steps=10) == 1
    assert not host.scheduler.has_requests()
    clock.now += 29.0
    assert host.drive_idle(max_steps=10) == 0
    clock.now += 1.0
    assert host.drive_idle(max_steps=10) == 1
    assert [s.consecutive for s in recorder.idle_steps()] == [1, 2]


def test_idle_steps_run_on_the_engine_thread_and_stream_never_during_work(
    host: OmlxContractHost, recorder: EventRecorder
) -> None:
    seen: list[tuple[str, str, bool]] = []
    done = threading.Event()

    def note(step: IdleStep) -> Any:
        scheduler = host.scheduler
        busy = bool(scheduler.waiting or scheduler.running or scheduler.prefilling)
        seen.append((threading.current_thread().name, str(mx.default_stream(mx.default_device())), busy))
        if step.consecutive >= 3:
            done.set()
            return None
        return True

    recorder.idle_answer = note
    host.start()
    try:
        rid = host.submit(contract_tokens(150, seed=1), max_tokens=4)
        assert host.wait(rid, 60.0).output_tokens
        assert done.wait(60.0)

        def engine_stream() -> str:
            with mx.stream(host.scheduler._stream):
                return str(mx.default_stream(mx.default_device()))

        expected_stream = host.core._mlx_executor.submit(engine_stream).result()
        expected_thread = host.core._mlx_executor.submit(lambda: threading.current_thread().name).result()
    finally:
        host.stop()
    assert len(seen) >= 3
    assert {thread for thread, _, _ in seen} == {expected_thread}
    assert {stream for _, stream, _ in seen} == {expected_stream}
    assert not any(busy for _, _, busy in seen)


def test_no_idle_step_while_oMLX_cache_writer_reads_buffers(
    host: OmlxContractHost, recorder: EventRecorder, clock: FakeClock
) -> None:
    import omlx.scheduler as scheduler_module

    held, release = threading.Event(), threading.Event()

    def writer() -> None:  # stands in for oMLX's store worker mid-write
        with scheduler_module._mx_buffer_access_lock:
            held.set()
            release.wait(60.0)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert held.wait(60.0)
        assert host.drive_idle(max_steps=10) == 0
        assert recorder.idle_steps() == []
    finally:
        release.set()
        thread.join(60.0)
    clock.now += 1.0
    assert host.drive_idle(max_steps=10) == 1


class ArrivalSignal:
    def __init__(self) -> None:
        self.arrived = threading.Event()

    @hookimpl
    def request_arrived(self, event: Any) -> None:
        self.arrived.set()


def test_an_arrival_counts_as_work_before_it_reaches_a_busy_engine_thread(
    host: OmlxContractHost,
) -> None:
    signal = ArrivalSignal()
    host.plugin_manager.register(signal)
    host.start()
    release, entered = threading.Event(), threading.Event()

    def long_step() -> None:  # stands in for a step (or an idle slice) in progress
        entered.set()
        release.wait(60.0)

    host.core._mlx_executor.submit(long_step)
    try:
        assert entered.wait(60.0)
        rids: list[str] = []
        submitter = threading.Thread(target=lambda: rids.append(host.submit(contract_tokens(90), max_tokens=3)))
        submitter.start()
        assert signal.arrived.wait(60.0)
        assert not host.scheduler.waiting  # still queued behind the engine thread
        assert not host.engine.queues_empty()
    finally:
        release.set()
    submitter.join(60.0)
    assert host.wait(rids[0], 60.0).output_tokens
    host.stop()
    assert host.engine.queues_empty()


def test_engine_stop_and_close_report_shutdown_then_unload_once(
    host: OmlxContractHost, recorder: EventRecorder
) -> None:
    host.start()
    host.stop()
    host.unload()
    hooks = [e.hook for e in recorder.snapshot() if e.hook in ("engine_shutdown", "model_unloaded", "engine_reset")]
    assert hooks == ["engine_shutdown", "model_unloaded", "engine_reset"]
    assert not host.scheduler.has_requests() if host.core.scheduler else True
