"""When an idle engine should be offered its next idle step: the core both hosts' idle
drivers share (:mod:`.omlx.idle_driver`, :mod:`.rapid.idle_driver`).

An idle step is wanted once after the engine's queues drain (or the engine is first seen,
or someone calls :meth:`IdleOffers.wake`), then again only while a hook implementation
asks: ``True`` for another step now, a positive float for one after that many seconds.
``None`` / ``False`` from everyone ends the offers until the engine next has work.

How an offer reaches the host's step (its thread, its MLX stream, its buffer lock, a
timer that wakes its loop) differs per host and stays in the subclasses.

Threads: the host's step thread runs :meth:`IdleOffers.offer_step`,
:meth:`~IdleOffers.record_results` and :meth:`~IdleOffers.note_work` and owns the two
counters; any thread may call :meth:`~IdleOffers.wake`, :meth:`~IdleOffers.stop` and
:meth:`~IdleOffers.wants_step`. The offer fields (``_offer``, ``_not_before``,
``_stopped``) are guarded by ``_lock``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

from ..events import IdleStep

# The longest delay an idle step is put off by: a hook that asks for more (a bug, a tiny
# budget share) is asked again after this, and no timer is armed with an interval its
# thread cannot wait for (threading.Timer dies on one that overflows).
MAX_IDLE_DELAY_S = 3600.0


def parse_results(results: Iterable[Any]) -> tuple[bool, list[float]]:
    """What the idle-step hook implementations asked for: another step now, and the
    positive finite delays (seconds, at most ``MAX_IDLE_DELAY_S``) the others asked for."""
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
            delays.append(min(float(result), MAX_IDLE_DELAY_S))
    return again_now, delays


class IdleOffers:
    """When one engine should be offered its next idle step."""

    #: The host driver's module logger (its failures are logged under the host's name).
    log: ClassVar[logging.Logger] = logging.getLogger(__name__)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._offer = False
        self._not_before = 0.0
        self._stopped = False
        #: Idle steps since the engine last had work, and in all (owned by the step thread).
        self.consecutive = 0
        self.offered = 0

    def wants_step(self) -> bool:
        """Should ``has_requests()`` say yes on behalf of an idle step now? Any thread."""
        with self._lock:
            return self._offer and not self._stopped and self._clock() >= self._not_before

    def note_work(self) -> None:
        """The engine had real work: offer one idle step once it drains. Step thread."""
        with self._lock:
            self._offer, self._not_before = True, 0.0
        self.consecutive = 0

    def wake(self) -> None:
        """Offer an idle step as soon as the engine is idle (a budget was raised, a job
        was queued from elsewhere). Any thread."""
        with self._lock:
            self._offer, self._not_before = True, 0.0
        self._woken()

    def stop(self) -> None:
        """No more idle steps for this engine (it is shutting down). Any thread."""
        with self._lock:
            self._stopped, self._offer = True, False

    def resume(self) -> None:
        """Undo :meth:`stop` (the engine was started again). Any thread."""
        with self._lock:
            self._stopped = False

    def next_count(self) -> int:
        """Count the idle step about to be offered. Step thread."""
        self.consecutive += 1
        return self.consecutive

    def offer_step(
        self,
        engine_id: str,
        emit: Callable[[IdleStep], list[Any]],
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        """Call the idle-step hook once, inside ``context()`` (e.g. the engine's MLX
        stream; made inside the ``try``, so a failure to enter it is the hook's failure),
        and apply the answers. Step thread, in place of a real ``step()``; never raises
        (a failure ends the offers)."""
        count = self.next_count()
        self.offered += 1
        try:
            with context():
                results = emit(IdleStep(engine_id=engine_id, consecutive=count))
        except Exception as exc:  # noqa: BLE001 - the host's step must never see it
            self.log.error("mlx-recovery: idle step on %s failed: %r", engine_id, exc)
            results = []
        self.record_results(results)

    def record_results(self, results: Iterable[Any]) -> None:
        """Apply what the idle-step hook implementations answered. Step thread."""
        again_now, delays = parse_results(results)
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
            self._delayed(delay)

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

    # -- for a host whose loop sleeps until woken -------------------------------------

    def _woken(self) -> None:
        """After :meth:`wake` (outside the lock): a host may wake its loop now."""

    def _delayed(self, delay: float) -> None:
        """After an answer asked for a step in ``delay`` seconds (outside the lock)."""
