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

Threads: the ``mlx-step`` thread runs :meth:`run_idle_step` and :meth:`note_work`; any
thread may call :meth:`wake`, :meth:`stop` and :meth:`wants_step` (``has_requests()``
runs on the event-loop thread). The offer fields are guarded by ``_lock``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ...events import IdleStep

log = logging.getLogger(__name__)


class IdleDriver:
    """When one engine should be offered its next idle step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._offer = False
        self._not_before = 0.0
        self._stopped = False
        self._timer: threading.Timer | None = None
        #: Sets the engine loop's wake-up event from any thread (None: not known yet).
        self.waker: Callable[[], None] | None = None
        #: Idle steps since the engine last had work, and in all (mlx-step thread).
        self.consecutive = 0
        self.offered = 0

    def wants_step(self) -> bool:
        """Should ``has_requests()`` say yes on behalf of an idle step now? Any thread."""
        with self._lock:
            return self._offer and not self._stopped and self._clock() >= self._not_before

    def note_work(self) -> None:
        """The engine had real work: offer one idle step once it drains."""
        with self._lock:
            self._offer, self._not_before = True, 0.0
        self.consecutive = 0

    def wake(self) -> None:
        """Offer an idle step as soon as the engine is idle. Any thread."""
        with self._lock:
            self._offer, self._not_before = True, 0.0
        self._poke()

    def stop(self) -> None:
        """No more idle steps (the engine is stopping). Any thread."""
        with self._lock:
            self._stopped, self._offer = True, False
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def resume(self) -> None:
        with self._lock:
            self._stopped = False

    def run_idle_step(self, engine_id: str, emit: Callable[[IdleStep], list[Any]]) -> None:
        """Offer one idle step to the plugins, in place of a real ``step()`` on the
        ``mlx-step`` thread. Never raises."""
        self.consecutive += 1
        self.offered += 1
        try:
            results = emit(IdleStep(engine_id=engine_id, consecutive=self.consecutive))
        except Exception as exc:  # noqa: BLE001 - the host's step must never see it
            log.error("mlx-recovery: idle step on %s failed: %r", engine_id, exc)
            results = []
        self.record_results(results)

    def record_results(self, results: Iterable[Any]) -> None:
        """Apply what the idle-step implementations answered."""
        again_now = False
        delays: list[float] = []
        for result in results:
            if result is True:
                again_now = True
            elif (
                isinstance(result, (int, float))
                and not isinstance(result, bool)
                and math.isfinite(result)
                and result > 0
            ):
                delays.append(float(result))
        delay = None
        with self._lock:
            if again_now:
                self._offer, self._not_before = True, 0.0
            elif delays:
                delay = min(delays)
                self._offer, self._not_before = True, self._clock() + delay
            else:
                self._offer = False
        if delay is not None:
            self._poke_after(delay)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            wait = max(0.0, self._not_before - self._clock()) if self._offer else None
            return {
                "offering": self._offer and not self._stopped,
                "wait_s": wait,
                "stopped": self._stopped,
                "consecutive": self.consecutive,
                "offered": self.offered,
            }

    # -- waking the engine loop -----------------------------------------------------

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
