"""The adapter's bookkeeping of rapid-mlx engines and requests, and its hook calls.

The wrappers (:mod:`.wrappers`) tell a :class:`Lifecycle` what rapid-mlx just did; it
keeps one :class:`EngineRecord` per scheduler (made, and ``engine_attached`` reported, on
first sight) with the requests the plugins were told about, so every arrival is reported
once and matched by exactly one departure, whichever rapid-mlx path removed the request.

PFlash: a compressed request's ``prompt_token_ids`` hold the kept tokens only (a
positional fiction rapid-mlx never caches); its ``original_prompt_token_ids`` hold the
prompt the client sent. The ``sparse_route_served`` event carries the original tokens,
so recovery's lineage is the conversation itself and what it publishes is the entry the
next turn's lookup of its (uncompressed) prompt finds.

The engine table, the request balance and the hook calls both hosts make alike are
:class:`~..records.EngineBook`'s; what is rapid-mlx's own here is what its queues mean
(no ``prefilling``: admitted means running) and PFlash.

Threads: wrappers call in on whatever thread rapid-mlx runs the method on (the
``mlx-step`` thread for the scheduler's work, the event-loop thread for ``EngineCore``'s
coroutines and ``has_requests``). The engine table is guarded by ``_lock``, each record by
its own ``lock``; hooks are called outside both. Nothing here raises into rapid-mlx:
:meth:`Lifecycle.safe` logs the adapter's own faults once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...events import DepartureReason, RequestAdmitted, RequestPrefilled, Route, SparseRouteServed
from ..records import EngineBook, EngineRecord, LiveRequest, door_tokens, tokens_of_prompt, tokens_of_request
from .idle_driver import IdleDriver

if TYPE_CHECKING:
    from ...plugins import HookEmitter

__all__ = [
    "EngineRecord",
    "Lifecycle",
    "LiveRequest",
    "door_tokens",
    "pflash_compressed",
    "pflash_settings",
    "tokens_of_prompt",
    "tokens_of_request",
]

log = logging.getLogger(__name__)


class Lifecycle(EngineBook):
    """Engines, requests and hook emission for one instrumentation of rapid-mlx. Its
    records (:class:`~..records.EngineRecord`) hold a :class:`~.ports.RapidEngine` and an
    :class:`~.idle_driver.IdleDriver`."""

    log = log
    fault_format = "mlx-recovery: rapid-mlx adapter error in %s: %r"

    def __init__(self, emitter: HookEmitter, clock: Callable[[], float], block_size: int) -> None:
        super().__init__(emitter, clock)
        self._block_size = block_size

    # -- engines -----------------------------------------------------------------------

    def _new_record(self, scheduler: Any) -> EngineRecord:
        from .ports import RapidEngine, model_id_of

        engine_id = self._engine_ids.get(scheduler) or f"rapid-{model_id_of(scheduler)}-{next(self._counter)}"
        box: list[EngineRecord] = []
        port = RapidEngine(
            scheduler, engine_id, block_size=self._block_size, pending_arrivals=lambda: box[0].pending_arrivals
        )
        record = EngineRecord(engine_id, port, IdleDriver(self._clock))
        box.append(record)
        return record

    def _log_attached(self, record: EngineRecord) -> None:
        port = record.port
        log.info(
            "mlx-recovery: engine %s attached (model %s, entries published in steps of %d tokens, "
            "prefix cache %s)",
            record.engine_id, port.model_id, port.block_size,
            "memory-aware" if port.prefix_cache.enabled else "not memory-aware: nothing can be recovered",
        )

    # -- requests ----------------------------------------------------------------------

    def sweep(self, record: EngineRecord, scheduler: Any, reason: DepartureReason) -> None:
        """Report departures rapid-mlx made without a method of its own."""
        with record.lock:
            gone = [
                rid for rid, live in record.live.items()
                if live.in_scheduler and rid not in scheduler.running and rid not in scheduler.requests
            ]
        for rid in gone:
            self.depart(record, rid, reason)

    def admitted(self, record: EngineRecord, scheduler: Any, before: list[str], began: float | None = None) -> None:
        """Report the requests of ``before`` (waiting a moment ago) now running."""
        for rid in before:
            request = scheduler.running.get(rid)
            if request is None:
                continue
            with record.lock:
                live = record.live.get(rid)
                if live is None or live.admitted:
                    continue
                record.mark_admitted(live, began if began is not None else self._clock())
            cached = int(getattr(request, "cached_tokens", 0) or 0)
            self.emitter.request_admitted(RequestAdmitted(record.engine_id, rid, cached))

    def sparse_served(self, record: EngineRecord, scheduler: Any, request_id: str) -> SparseRouteServed | None:
        """The event for a running request PFlash compressed and that made its first
        token, else None. Its tokens are the original (uncompressed) prompt."""
        request = scheduler.running.get(request_id)
        if request is None or not pflash_compressed(request):
            return None
        if not getattr(request, "output_token_ids", None):
            return None  # its compressed prefill never completed
        tokens = tuple(int(t) for t in (request.original_prompt_token_ids or ()))
        if not tokens:
            return None
        threshold, keep = pflash_settings(scheduler)
        with record.lock:
            # It may have finished in the step that made its first token.
            seen = record.seen_prefilled(request_id, self._clock())
        prefill_s = seen.prefill_seconds() if seen is not None else None
        return SparseRouteServed(
            engine_id=record.engine_id,
            request_id=request_id,
            model_id=record.port.model_id,
            tokens=tokens,
            served_start=0,  # a compressed request reuses no cached prefix
            served_end=len(tokens),
            threshold=threshold,
            keep=keep,
            prefill_s=prefill_s,
            keyed_beyond_tokens=bool(getattr(request, "is_multimodal", False)),
        )

    def prefill_event(self, record: EngineRecord, scheduler: Any, request_id: str, live: LiveRequest) -> RequestPrefilled | None:
        request = scheduler.running.get(request_id)
        sparse = request is not None and pflash_compressed(request)
        prefill_s = live.prefill_seconds()
        if request is None or prefill_s is None:
            return None
        tokens = getattr(request, "original_prompt_token_ids", None) if sparse else None
        tokens = tokens or getattr(request, "prompt_token_ids", None) or ()
        return RequestPrefilled(
            engine_id=record.engine_id,
            request_id=request_id,
            model_id=record.port.model_id,
            tokens=tuple(int(t) for t in tokens),
            cached_tokens=0 if sparse else int(getattr(request, "cached_tokens", 0) or 0),
            route=Route.SPARSE if sparse else Route.DENSE,
            prefill_s=prefill_s,
        )

    # -- steps -------------------------------------------------------------------------

    def idle_now(self, record: EngineRecord, scheduler: Any) -> bool:
        if scheduler.waiting or scheduler.running:
            return False
        if record.pending_arrivals > 0 or not record.attached:
            return False
        return record.driver.wants_step()


def pflash_compressed(request: Any) -> bool:
    """rapid-mlx's own test: PFlash replaced this request's prompt with kept tokens."""
    metadata = getattr(request, "pflash_metadata", None)
    return bool(metadata and metadata.get("compressed", False))


def pflash_settings(scheduler: Any) -> tuple[int | None, float | None]:
    """PFlash's threshold and keep ratio on this scheduler (None where unknown)."""
    config = getattr(getattr(scheduler, "config", None), "pflash_config", None)
    threshold = getattr(config, "threshold", None)
    keep = getattr(config, "keep_ratio", None)
    return (
        int(threshold) if threshold is not None else None,
        float(keep) if keep is not None else None,
    )

