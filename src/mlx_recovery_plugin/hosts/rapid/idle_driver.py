"""Idle driving: an idle rapid-mlx engine never steps, so the adapter offers idle steps.

rapid-mlx's engine loop (``EngineCore._engine_loop``, on the event-loop thread) submits
``scheduler.step()`` to its single ``mlx-step`` worker thread only while
``scheduler.has_requests()`` is true; otherwise it waits on an event that
``add_request`` sets, with a ``step_interval`` (5 s) timeout. The adapter answers
``has_requests()`` with "yes" while an idle step is wanted, and its ``step()`` wrapper
runs the ``engine_idle_step`` hook in place of a real step when the queues are empty, so
idle steps run on the ``mlx-step`` thread, strictly between real steps, and never on
another thread. An idle step asked for "after N seconds" is woken by a timer that sets
the engine loop's event (through the loop, thread-safely); without one the loop's own
timeout brings it at most ``step_interval`` late.

When an idle step is wanted: once after the engine's queues drain (or the engine is first
seen, or :meth:`IdleDriver.wake`), then again only while a hook implementation asks:
``True`` for another step now, a positive float for one after that many seconds.

The offer bookkeeping is :class:`~..idle_offers.IdleOffers`, shared with the oMLX family;
what is rapid-mlx's own is the waker and the timer (oMLX's loop polls, rapid-mlx's sleeps).

Threads: the ``mlx-step`` thread runs :meth:`run_idle_step` and :meth:`note_work`; any
thread may call :meth:`wake`, :meth:`stop` and :meth:`wants_step` (``has_requests()``
runs on the event-loop thread). The offer fields and ``_timer`` are guarded by ``_lock``;
the timer's own thread only calls the waker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...events import IdleStep
from ..idle_offers import IdleOffers

log = logging.getLogger(__name__)


class IdleDriver(IdleOffers):
    """When one rapid-mlx engine should be offered its next idle step, and waking its
    loop for it."""

    log = log

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._timer: threading.Timer | None = None
        #: Sets the engine loop's wake-up event from any thread (None: not known yet).
        self.waker: Callable[[], None] | None = None

    def stop(self) -> None:
        """No more idle steps (the engine is stopping). Any thread."""
        with self._lock:
            self._stopped, self._offer = True, False
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def run_idle_step(self, engine_id: str, emit: Callable[[IdleStep], list[Any]]) -> None:
        """Offer one idle step to the plugins, in place of a real ``step()`` on the
        ``mlx-step`` thread. Never raises."""
        self.offer_step(engine_id, emit)

    # -- waking the engine loop -----------------------------------------------------

    def _woken(self) -> None:
        self._poke()

    def _delayed(self, delay: float) -> None:
        self._poke_after(delay)

    def _poke(self) -> None:
        waker = self.waker
        if waker is None:
            return
        try:
            waker()
        except Exception as exc:  # noqa: BLE001 - a closed loop: its own timeout wakes it
            log.debug("mlx-recovery: could not wake the rapid-mlx engine loop: %r", exc)

    def _poke_after(self, delay: float) -> None:
        if self.waker is None:
            return
        timer = threading.Timer(delay, self._poke)
        timer.daemon = True
        with self._lock:
            if self._stopped:
                return
            old, self._timer = self._timer, timer
        if old is not None:
            old.cancel()
        timer.start()
