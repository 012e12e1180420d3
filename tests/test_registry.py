"""The arrival registry: foreground work is any request arrived and not departed, anywhere."""

from __future__ import annotations

import logging
import queue
import threading

from mlx_recovery_plugin.recovery.registry import (
    ADMISSION_UNKNOWN,
    DEPARTURE_UNKNOWN,
    DUPLICATE_ARRIVAL,
    RECENT_ARRIVAL_TIMES,
    SECOND_DEPARTURE,
    STALE_ARRIVAL,
    ArrivalRegistry,
)


def active_on(registry: ArrivalRegistry, engine_id: str) -> int:
    return registry.snapshot()["engines"].get(engine_id, {}).get("active", 0)


def test_arrival_is_foreground_work_until_departure() -> None:
    registry = ArrivalRegistry()
    assert not registry.foreground_active()
    registry.arrived("e1", "r1")
    assert registry.foreground_active()
    registry.admitted("e1", "r1")
    assert registry.foreground_active(), "admission does not end foreground work"
    registry.departed("e1", "r1")
    assert not registry.foreground_active()


def test_a_request_on_any_engine_keeps_the_whole_process_busy() -> None:
    registry = ArrivalRegistry()
    registry.arrived("e1", "r1")
    registry.arrived("e2", "r2")
    registry.departed("e1", "r1")
    assert registry.foreground_active()
    assert active_on(registry, "e1") == 0
    assert active_on(registry, "e2") == 1
    registry.departed("e2", "r2")
    assert not registry.foreground_active()


def test_the_same_request_id_on_two_engines_counts_twice() -> None:
    registry = ArrivalRegistry()
    registry.arrived("e1", "r")
    registry.arrived("e2", "r")
    registry.departed("e1", "r")
    assert registry.foreground_active()
    assert registry.snapshot()["engines"] == {"e2": {"active": 1, "admitted": 0}}


def test_bad_input_never_raises_and_changes_nothing() -> None:
    registry = ArrivalRegistry()
    registry.arrived("e1", "live")
    registry.departed("e1", "never-arrived")
    registry.admitted("e1", "never-arrived")
    registry.arrived("e1", "live")
    registry.arrived("e1", "done")
    registry.departed("e1", "done")
    registry.departed("e1", "done")
    registry.admitted("e9", "nobody")

    snap = registry.snapshot()
    assert snap["active"] == 1 and active_on(registry, "e1") == 1
    assert snap["bad_input"] == {
        DEPARTURE_UNKNOWN: 1,
        ADMISSION_UNKNOWN: 2,
        DUPLICATE_ARRIVAL: 1,
        SECOND_DEPARTURE: 1,
    }
    registry.departed("e1", "live")
    assert not registry.foreground_active()


def test_bad_input_is_logged_once_per_kind(caplog) -> None:
    registry = ArrivalRegistry()
    with caplog.at_level(logging.WARNING, logger="mlx_recovery_plugin.recovery.registry"):
        for i in range(5):
            registry.departed("e1", f"ghost-{i}")
            registry.admitted("e1", f"ghost-{i}")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert any("departure before arrival" in m for m in messages)
    assert any("admission of unknown request" in m for m in messages)
    assert registry.snapshot()["bad_input"] == {DEPARTURE_UNKNOWN: 5, ADMISSION_UNKNOWN: 5}


def test_a_request_id_may_be_reused_after_its_departure() -> None:
    registry = ArrivalRegistry()
    registry.arrived("e1", "r1")
    registry.departed("e1", "r1")
    registry.arrived("e1", "r1")
    assert registry.foreground_active()
    registry.departed("e1", "r1")
    assert not registry.foreground_active()
    assert registry.snapshot()["bad_input"] == {}


def test_forgetting_an_engine_ends_its_foreground_work() -> None:
    registry = ArrivalRegistry()
    registry.arrived("e1", "a")
    registry.arrived("e1", "b")
    registry.arrived("e2", "c")
    assert registry.forget_engine("e1") == 2
    assert active_on(registry, "e1") == 0 and registry.foreground_active()
    registry.departed("e1", "a")  # the host reports it late: a second departure, ignored
    assert registry.snapshot()["bad_input"] == {SECOND_DEPARTURE: 1}


def test_arrival_count_grows_with_each_new_arrival_from_any_thread() -> None:
    registry = ArrivalRegistry()
    worker = threading.Thread(target=lambda: [registry.arrived("e1", f"r{i}") for i in range(3)])
    worker.start()
    worker.join(timeout=10)
    assert registry.arrivals() == 3
    registry.arrived("e1", "r0")  # a duplicate is not a new arrival
    assert registry.arrivals() == 3
    registry.departed("e1", "r0")
    assert registry.arrivals() == 3  # departures never move it back


def test_eight_threads_of_arrivals_and_departures_leave_the_registry_empty() -> None:
    registry = ArrivalRegistry()
    start = threading.Barrier(9)

    def engine(n: int) -> None:
        start.wait()
        for i in range(500):
            rid = f"r{i}"  # the same ids on every engine, and reused after departure
            registry.arrived(f"e{n}", rid)
            registry.admitted(f"e{n}", rid)
            registry.departed(f"e{n}", rid)
            registry.arrived(f"e{n}", rid)
            registry.departed(f"e{n}", rid)

    def reader() -> None:
        start.wait()
        for _ in range(2000):
            registry.foreground_active()
            registry.snapshot()

    threads = [threading.Thread(target=engine, args=(n,)) for n in range(8)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    snap = registry.snapshot()
    assert not registry.foreground_active()
    assert snap["active"] == 0 and snap["engines"] == {}
    assert snap["arrivals"] == snap["departures"] == 8 * 500 * 2
    assert snap["bad_input"] == {}


def test_arrivals_on_request_threads_and_departures_on_engine_threads_balance() -> None:
    registry = ArrivalRegistry()
    handoff: queue.Queue[tuple[str, str] | None] = queue.Queue()

    def request_thread(n: int) -> None:
        for i in range(500):
            engine_id, rid = f"e{i % 2}", f"t{n}-{i}"
            registry.arrived(engine_id, rid)
            handoff.put((engine_id, rid))

    def engine_thread() -> None:
        while (item := handoff.get()) is not None:
            registry.admitted(*item)
            registry.departed(*item)

    producers = [threading.Thread(target=request_thread, args=(n,)) for n in range(4)]
    consumers = [threading.Thread(target=engine_thread) for _ in range(4)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join()
    for _ in consumers:
        handoff.put(None)
    for t in consumers:
        t.join()

    assert not registry.foreground_active()
    assert registry.snapshot()["arrivals"] == 2000
    assert registry.snapshot()["bad_input"] == {}


def test_arrivals_since_a_count_give_each_later_arrivals_time() -> None:
    now = [10.0]
    registry = ArrivalRegistry(clock=lambda: now[0])
    assert registry.arrivals_since(0) == (0, ())
    registry.arrived("e1", "a")
    seen, _ = registry.arrivals_since(0)
    now[0] = 11.0
    registry.arrived("e1", "b")
    registry.arrived("e1", "b")  # a duplicate is no arrival and has no time
    now[0] = 12.5
    registry.arrived("e2", "c")
    assert registry.arrivals_since(seen) == (3, (11.0, 12.5))
    assert registry.arrivals_since(3) == (3, ())
    for i in range(RECENT_ARRIVAL_TIMES + 5):
        registry.arrived("e1", f"many{i}")
    count, times = registry.arrivals_since(0)
    assert count == RECENT_ARRIVAL_TIMES + 8 and len(times) == RECENT_ARRIVAL_TIMES  # the latest ones


def test_an_arrival_that_never_departs_stops_counting_after_the_age_bound(caplog) -> None:
    now = [0.0]
    registry = ArrivalRegistry(max_age_s=60.0, clock=lambda: now[0])
    registry.arrived("e1", "lost")
    now[0] = 30.0
    registry.arrived("e1", "fresh")
    now[0] = 61.0
    with caplog.at_level(logging.WARNING, logger="mlx_recovery_plugin.recovery.registry"):
        assert registry.foreground_active()  # "fresh" is 31 s old: still foreground
    assert active_on(registry, "e1") == 1
    assert registry.snapshot()["bad_input"] == {STALE_ARRIVAL: 1}
    assert "'lost' on 'e1' arrived 61 s ago and never departed" in caplog.text
    registry.departed("e1", "fresh")
    assert not registry.foreground_active()
    registry.departed("e1", "lost")  # the host's late word: a second departure, ignored
    assert registry.snapshot()["bad_input"] == {STALE_ARRIVAL: 1, SECOND_DEPARTURE: 1}
