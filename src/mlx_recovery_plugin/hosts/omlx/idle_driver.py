"""Idle driving: an idle oMLX engine never steps, so the adapter offers idle steps itself.

oMLX's engine loop calls ``scheduler.step()`` on the engine's single-thread executor only
while ``scheduler.has_requests()`` is true, and otherwise sleeps a millisecond and asks
again. The adapter answers ``has_requests()`` with "yes" while an idle step is wanted, and
its ``step()`` wrapper runs the ``engine_idle_step`` hook instead of a real step when the
queues are empty. So idle steps run on the engine's own executor thread and MLX stream,
strictly between real steps, and the first real request takes the next step.

When an idle step is wanted: once after the engine's queues drain (or the engine is first
seen, or someone calls :meth:`IdleDriver.wake`), then again only while a hook
implementation asks: ``True`` for another step now, a positive float for one after that
many seconds. ``None`` / ``False`` from everyone ends the offers until the engine next
has work.

Threads: the engine thread runs :meth:`record_results` and :meth:`note_work`; any thread
may call :meth:`wake`, :meth:`stop` and :meth:`wants_step` (the engine loop's
``has_requests()`` runs on the event-loop thread). The three fields are guarded by
``_lock``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

from ...events import IdleStep

log = logging.getLogger(__name__)

# How long to wait before offering again when the host's buffer lock is busy.
GUARD_RETRY_S = 0.05


class IdleDriver:
    """When one engine should be offered its next idle step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._offer = False
        self._not_before = 0.0
        self._stopped = False
        #: Idle steps since the engine last had work, and in all (owned by the engine thread).
        self.consecutive = 0
        self.offered = 0

    def wants_step(self) -> bool:
        """Should ``has_requests()`` say yes on behalf of an idle step now? Any thread."""
        with self._lock:
            return self._offer and not self._stopped and self._clock() >= self._not_before

    def note_work(self) -> None:
        """The engine had real work: offer one idle step once it drains. Engine thread."""
        with self._lock:
            self._offer = True
            self._not_before = 0.0
        self.consecutive = 0

    def wake(self) -> None:
        """Offer an idle step as soon as the engine is idle (a budget was raised, a job
        was queued from elsewhere). Any thread."""
        with self._lock:
            self._offer = True
            self._not_before = 0.0

    def stop(self) -> None:
        """No more idle steps for this engine (it is shutting down). Any thread."""
        with self._lock:
            self._stopped = True
            self._offer = False

    def resume(self) -> None:
        """Undo :meth:`stop` (the engine was started again). Any thread."""
        with self._lock:
            self._stopped = False

    def next_count(self) -> int:
        """Count the idle step about to be offered. Engine thread."""
        self.consecutive += 1
        return self.consecutive

    def run_idle_step(
        self,
        engine_id: str,
        stream: Any,
        emit: Callable[[IdleStep], list[Any]],
        guard: Any = None,
    ) -> bool:
        """Offer one idle step to the plugins, on ``stream``. Engine thread, in place of
        a real ``step()``; never raises (a failure ends the offers).

        ``guard`` is a lock the host's background cache writer holds while it reads MLX
        buffers; the idle step holds it too, so a slice that frees MLX memory never
        overlaps that read. When the writer has it, no step is offered now and the
        offer comes back shortly. Returns whether the hook was called.
        """
        if guard is not None and not guard.acquire(blocking=False):
            with self._lock:
                if self._offer:
                    self._not_before = self._clock() + GUARD_RETRY_S
            return False
        try:
            count = self.next_count()
            self.offered += 1
            try:
                with _on_stream(stream):
                    results = emit(IdleStep(engine_id=engine_id, consecutive=count))
            except Exception as exc:  # noqa: BLE001 - the host's step must never see it
                log.error("mlx-recovery: idle step on %s failed: %r", engine_id, exc)
                results = []
            self.record_results(results)
            return True
        finally:
            if guard is not None:
                guard.release()

    def record_results(self, results: Iterable[Any]) -> None:
        """Apply what the idle-step hook implementations answered. Engine thread."""
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
        with self._lock:
            if again_now:
                self._offer, self._not_before = True, 0.0
            elif delays:
                self._offer, self._not_before = True, self._clock() + min(delays)
            else:
                self._offer = False

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


def _on_stream(stream: Any) -> Any:
    """``mx.stream(stream)``; MLX is imported here, not when the start-up hook loads us."""
    if stream is None:
        return nullcontext()
    import mlx.core as mx

    return mx.stream(stream)
