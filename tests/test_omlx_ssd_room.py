"""A store waits for room in oMLX's SSD write queue, which drops a block that finds it
full (and the store rolls back to before that block). The wait's arithmetic here, on a
real bounded queue with an injected clock; the real scheduler's queue in
tests/test_omlx_ports.py."""

from __future__ import annotations

import queue
from types import SimpleNamespace

from mlx_recovery_plugin.hosts.omlx.ports import SSD_QUEUE_POLL_S, wait_for_ssd_room
from mlx_recovery_plugin.testing.clock import FakeClock


def _full_queue(depth: int) -> queue.Queue[object]:
    pending: queue.Queue[object] = queue.Queue(maxsize=depth)
    for i in range(depth):
        pending.put_nowait(i)
    return pending


def test_a_store_waits_until_the_writer_takes_a_block_off_a_full_queue() -> None:
    pending = _full_queue(2)
    cache = SimpleNamespace(paged_ssd_cache=SimpleNamespace(_write_queue=pending, _hot_cache_enabled=False))
    clock, sleeps = FakeClock(), []

    def writer_takes_one_on_the_third_poll(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)
        if len(sleeps) == 3:
            pending.get_nowait()

    assert wait_for_ssd_room(cache, wait_s=1.0, clock=clock, sleep=writer_takes_one_on_the_third_poll)
    assert sleeps == [SSD_QUEUE_POLL_S] * 3 and not pending.full()


def test_the_wait_is_bounded_and_says_when_the_queue_stayed_full() -> None:
    cache = SimpleNamespace(paged_ssd_cache=SimpleNamespace(_write_queue=_full_queue(1), _hot_cache_enabled=False))
    clock = FakeClock()
    assert not wait_for_ssd_room(cache, wait_s=0.5, clock=clock, sleep=clock.advance)
    assert 0.5 <= clock.now < 0.5 + 2 * SSD_QUEUE_POLL_S


def test_no_wait_without_a_queue_that_drops_blocks() -> None:
    def no_sleep(seconds: float) -> None:
        raise AssertionError("waited")

    hot = SimpleNamespace(paged_ssd_cache=SimpleNamespace(_write_queue=_full_queue(1), _hot_cache_enabled=True))
    for cache in (SimpleNamespace(paged_ssd_cache=None), SimpleNamespace(), hot):
        assert wait_for_ssd_room(cache, wait_s=1.0, sleep=no_sleep)
