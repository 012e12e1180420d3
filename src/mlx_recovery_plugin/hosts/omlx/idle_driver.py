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

The offer bookkeeping is :class:`~..idle_offers.IdleOffers`, shared with rapid-mlx; what
is oMLX's own is running the step on the engine's stream under the host's buffer lock.

Threads: the engine thread runs :meth:`run_idle_step`, :meth:`record_results` and
:meth:`note_work`; any thread may call :meth:`wake`, :meth:`stop` and :meth:`wants_step`
(the engine loop's ``has_requests()`` runs on the event-loop thread). The offer fields
are guarded by ``_lock``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from ...events import IdleStep
from ..idle_offers import IdleOffers

log = logging.getLogger(__name__)

# How long to wait before offering again when the host's buffer lock is busy.
GUARD_RETRY_S = 0.05


class IdleDriver(IdleOffers):
    """When one oMLX engine should be offered its next idle step, and running it."""

    log = log

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
            self.offer_step(engine_id, emit, lambda: _on_stream(stream))
            return True
        finally:
            if guard is not None:
                guard.release()


def _on_stream(stream: Any) -> Any:
    """``mx.stream(stream)``; MLX is imported here, not when the start-up hook loads us."""
    if stream is None:
        return nullcontext()
    import mlx.core as mx

    return mx.stream(stream)
