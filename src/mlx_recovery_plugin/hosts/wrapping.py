"""Wrapper factories both host adapters' tables share, where the host methods they wrap
mean the same on oMLX and rapid-mlx (both schedulers descend from one design).

Each factory takes the host's lifecycle (an :class:`~.records.EngineBook` with the
host's ``admitted`` / ``sparse_served``), the original function and the originals table,
and returns a function with the same call signature that runs the original unchanged and
tells the lifecycle what happened; the original's exceptions pass through untouched.
Where the hosts differ (their ``add_request`` refusals, ``has_requests``, ``step``,
``deep_reset``, failures, ``start``), the factories stay in each host's ``wrappers`` module.

Threads: each wrapper runs on the thread the host calls the method on (named per host in
its ``instrumentor`` table); the shared state it touches is the lifecycle's, under the
lifecycle's locks.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..events import DepartureReason
from .records import tokens_of_prompt

Fn = Callable[..., Any]
#: ``(lifecycle, original, originals by "Class.method") -> wrapper``
Factory = Callable[[Any, Fn, Mapping[str, Fn]], Fn]


# -- Scheduler (the host's step thread) ----------------------------------------------------


def _waiting_ids(scheduler: Any) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def scheduler_schedule_waiting(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def _schedule_waiting(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        before = (life.safe(_waiting_ids, scheduler) or []) if record is not None else []
        # oMLX prefills inside admission: a request's prefill begins when this call does.
        began = life.admission_began() if before else None
        result = original(scheduler, *args, **kwargs)
        if record is not None and before:
            life.safe(life.admitted, record, scheduler, before, began)
        return result

    return _schedule_waiting


def scheduler_cleanup_finished(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def _cleanup_finished(scheduler: Any, finished_ids: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is not None and finished_ids is not None and not isinstance(finished_ids, Collection):
            finished_ids = list(finished_ids)  # an iterator read here would reach the host empty
        ids = list(finished_ids or ()) if record is not None else []
        served = []
        if record is not None:
            # A request can finish in the step that made its first token (one token asked
            # for, or an end of sequence at once): time its prefill now, while it is still
            # in ``running``, or it would depart unreported.
            life.safe(life.note_first_tokens, record, scheduler)
            # Read before the original drops the finished requests from ``running``.
            for rid in ids:
                event = life.safe(life.sparse_served, record, scheduler, rid)
                if event is not None:
                    served.append(event)
        result = original(scheduler, finished_ids, *args, **kwargs)
        if record is not None:
            for event in served:
                life.emitter.sparse_route_served(event)
            for rid in ids:
                life.safe(life.depart, record, rid, DepartureReason.FINISHED)
        return result

    return _cleanup_finished


def scheduler_do_abort_request(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Where a queued ``abort_request`` is applied (inside ``step()``, or by ``reset()``)."""

    def _do_abort_request(scheduler: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        served = life.safe(life.sparse_served, record, scheduler, request_id) if record else None
        aborted = original(scheduler, request_id, *args, **kwargs)
        if record is not None and aborted:
            if served is not None:
                life.emitter.sparse_route_served(served)
            life.emitter.request_aborted(record.engine_id, request_id)
            life.safe(life.depart, record, request_id, DepartureReason.ABORTED)
        return aborted

    return _do_abort_request


def resetting(deep: bool) -> Factory:
    """A reset that empties the host's prefix cache: ``engine_reset`` (``deep`` as the
    host means it) before the cache is emptied, so plugins give their blocks back while
    they exist; not inside ``deep_reset`` (which reports itself). Then the sweep of what
    the reset dropped."""

    def factory(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
        def reset(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            record = life.get(scheduler)
            if record is not None and not getattr(life.local, "deep_reset", False):
                life.emitter.engine_reset(record.engine_id, deep)
            result = original(scheduler, *args, **kwargs)
            if record is not None:
                life.safe(life.sweep, record, scheduler, DepartureReason.ABORTED)
            return result

        return reset

    return factory


# -- EngineCore (the event-loop thread, and whoever builds or closes it) -------------------


def engine_add_request(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Reports the arrival before the request queues for the step thread, which may be
    busy with a step or an idle slice that must yield to it."""
    signature = inspect.signature(original)

    async def add_request(engine: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(engine, "scheduler", None)
        try:
            bound = signature.bind(engine, *args, **kwargs)
        except TypeError:
            bound = None  # the host reports the bad call itself
        if bound is None or scheduler is None:
            return await original(engine, *args, **kwargs)
        if bound.arguments.get("request_id") is None:
            # EngineCore would make this same kind of id itself, a moment later.
            bound.arguments["request_id"] = str(uuid.uuid4())
        rid = bound.arguments["request_id"]
        record = life.safe(life.engine, scheduler)
        reported = False
        if record is not None:
            tokens = tokens_of_prompt(bound.arguments.get("prompt"))
            reported = bool(life.safe(life.arrive, record, rid, tokens, False))
            # Event-loop thread; the step thread reads it (idle_now) under the same lock.
            with record.lock:
                record.pending_arrivals += 1
        try:
            return await original(*bound.args, **bound.kwargs)
        except BaseException as exc:
            if reported and rid not in getattr(scheduler, "requests", {}):
                import asyncio  # loaded already (this runs on its loop); kept off import time

                cancelled = isinstance(exc, asyncio.CancelledError)
                reason = DepartureReason.ABORTED if cancelled else DepartureReason.FAILED
                life.safe(life.depart, record, rid, reason)
            raise
        finally:
            if record is not None:
                with record.lock:
                    record.pending_arrivals -= 1

    return add_request


def engine_stop(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """On the host's event loop: the shutdown hook runs on a worker thread, so the loop
    keeps serving while plugins wait for a running slice to stop, and the host's own stop
    starts only once they have (nothing of theirs is written to the engine after it)."""

    async def stop(engine: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(engine, "scheduler", None)
        record = life.get(scheduler) if scheduler is not None else None
        if record is not None and life.safe(life.detach, record):
            import asyncio  # loaded already (this runs on its loop); kept off import time

            await asyncio.to_thread(life.emitter.engine_shutdown, record.engine_id)
        return await original(engine, *args, **kwargs)

    return stop


def engine_close(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Model unloads reach here (oMLX's ``EnginePool`` and rapid-mlx's idle unload, both
    through ``BatchedEngine.stop``)."""

    def close(engine: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(engine, "scheduler", None)
        record = life.get(scheduler) if scheduler is not None else None
        if record is not None and not getattr(engine, "_closed", False):
            # The host stops an engine before closing it; a bare close() reports both too.
            if life.safe(life.detach, record):
                life.emitter.engine_shutdown(record.engine_id)
            life.emitter.model_unloaded(record.engine_id, record.port.model_id)
        return original(engine, *args, **kwargs)

    return close


def engine_init(built: Callable[[Any, Any], None]) -> Factory:
    """``EngineCore.__init__``: after the original, ``built(life, engine)`` (the host's
    naming and first attach), its faults logged by ``life.safe``."""

    def factory(life: Any, original: Fn, originals: Mapping[str, Fn]) -> Fn:
        def __init__(engine: Any, *args: Any, **kwargs: Any) -> None:
            original(engine, *args, **kwargs)
            life.safe(built, life, engine)

        return __init__

    return factory

