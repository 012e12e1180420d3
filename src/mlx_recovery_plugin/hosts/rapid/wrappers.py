"""The wrappers that replace rapid-mlx methods while the adapter is attached.

Each factory takes the :class:`~.lifecycle.Lifecycle` and the original function and
returns a function with the same call signature that runs the original unchanged and
tells the lifecycle what happened. The original's exceptions pass through untouched; the
adapter's own faults are logged by ``Lifecycle.safe``. :data:`FACTORIES` lists them by
``(class name, method name)``; which hook each becomes, on which thread, is tabled in
:mod:`.instrumentor`.
"""

from __future__ import annotations

import inspect
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ...events import DepartureReason
from .lifecycle import Lifecycle, tokens_of_prompt, tokens_of_request

Fn = Callable[..., Any]
Factory = Callable[[Lifecycle, Fn, Mapping[str, Fn]], Fn]

FAILED_ALL_ERROR = "rapid-mlx failed every running request after a generation error"


# -- Scheduler (the mlx-step thread, except has_requests) ---------------------------------


def scheduler_add_request(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def add_request(scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.safe(life.engine, scheduler)
        rid = getattr(request, "request_id", None)
        if record is not None and rid is not None:
            life.safe(life.arrive, record, rid, tokens_of_request(request), False)
        try:
            result = original(scheduler, request, *args, **kwargs)
        except BaseException:
            # Refused at the door (backpressure, a bad prompt): it never queued.
            if record is not None and rid is not None:
                life.safe(life.depart, record, rid, DepartureReason.FAILED)
            raise
        if record is not None and rid is not None:
            life.safe(life.arrive, record, rid, (), True)
        return result

    return add_request


def scheduler_has_requests(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Also "yes" while an idle step is wanted: the engine loop then submits ``step()``.
    Runs on the event-loop thread: reads only."""

    def has_requests(scheduler: Any) -> bool:
        if original(scheduler):
            return True
        if getattr(life.local, "plain_has_requests", False):
            return False  # rapid-mlx asking itself (clear_prefix_cache): requests only
        record = life.get(scheduler)
        if record is None:
            return False
        try:
            return record.attached and record.driver.wants_step()
        except Exception:  # noqa: BLE001
            return False

    return has_requests


def scheduler_step(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    host_has_requests = originals["Scheduler.has_requests"]
    output_type = sys.modules[original.__module__].SchedulerOutput  # what an idle step returns

    def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is None:
            return original(scheduler, *args, **kwargs)
        real_work = bool(scheduler.waiting or scheduler.running)
        # An idle step only where rapid-mlx itself would not step at all (a queued abort
        # is applied by a real step).
        if real_work or getattr(scheduler, "_pending_abort_ids", None) or host_has_requests(scheduler):
            record.port.stepping = True
            try:
                output = original(scheduler, *args, **kwargs)
            finally:
                record.port.stepping = False
            life.safe(life.after_step, record, scheduler, real_work)
            return output
        if life.safe(life.idle_now, record, scheduler):
            record.driver.run_idle_step(record.engine_id, life.engine_idle_step)
        return output_type()

    return step


def scheduler_schedule_waiting(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def _schedule_waiting(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        before = [r.request_id for r in scheduler.waiting] if record is not None else []
        result = original(scheduler, *args, **kwargs)
        if record is not None and before:
            life.safe(life.admitted, record, scheduler, before)
        return result

    return _schedule_waiting


def scheduler_cleanup_finished(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def _cleanup_finished(scheduler: Any, finished_ids: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        ids = list(finished_ids or ())
        served = []
        if record is not None:
            for rid in ids:
                event = life.safe(life.sparse_served, record, scheduler, rid)
                if event is not None:
                    served.append(event)
        result = original(scheduler, finished_ids, *args, **kwargs)
        if record is not None:
            for event in served:
                life.sparse_route_served(event)
            for rid in ids:
                life.safe(life.depart, record, rid, DepartureReason.FINISHED)
        return result

    return _cleanup_finished


def scheduler_do_abort_request(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Where a queued ``abort_request`` is applied (inside ``step()``, or by ``reset()``)."""

    def _do_abort_request(scheduler: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        served = life.safe(life.sparse_served, record, scheduler, request_id) if record else None
        aborted = original(scheduler, request_id, *args, **kwargs)
        if record is not None and aborted:
            if served is not None:
                life.sparse_route_served(served)
            life.request_aborted(record, request_id)
            life.safe(life.depart, record, request_id, DepartureReason.ABORTED)
        return aborted

    return _do_abort_request


def scheduler_recover_from_generation_error(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """rapid-mlx calls it from inside ``step()``'s ``except`` block: the step's error is
    the exception being handled."""

    def _recover_from_generation_error(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        handling = sys.exc_info()[1]
        failed = original(scheduler, *args, **kwargs)
        record = life.get(scheduler)
        if record is not None:
            error = f"{type(handling).__name__}: {handling}" if handling is not None else FAILED_ALL_ERROR
            life.engine_failed_all(record, error)
            for rid in list(failed or ()):
                life.safe(life.depart, record, rid, DepartureReason.FAILED)
        return failed

    return _recover_from_generation_error


def _resetting(deep_flag: bool) -> Factory:
    """rapid-mlx's ``reset()`` and cache-error recovery empty the prefix cache too: both
    are deep resets for the plugins, reported before the cache is emptied."""

    def factory(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
        def wrapper(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            record = life.get(scheduler)
            if record is not None and not getattr(life.local, "deep_reset", False):
                life.engine_reset(record, deep=deep_flag)
            result = original(scheduler, *args, **kwargs)
            if record is not None:
                life.safe(life.sweep, record, scheduler, DepartureReason.ABORTED)
            return result

        return wrapper

    return factory


def scheduler_deep_reset(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def deep_reset(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is not None:
            life.engine_reset(record, deep=True)
        life.local.deep_reset = True
        try:
            return original(scheduler, *args, **kwargs)
        finally:
            life.local.deep_reset = False

    return deep_reset


def scheduler_clear_prefix_cache(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """``--idle-cache-clear-seconds`` (and the admin route) empty the prefix cache: what
    recovery published is gone, so its jobs are told, once the clear happened."""

    def clear_prefix_cache(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        # It refuses while has_requests() says yes; a wanted idle step is no request.
        life.local.plain_has_requests = True
        try:
            cleared = original(scheduler, *args, **kwargs)
        finally:
            life.local.plain_has_requests = False
        record = life.get(scheduler)
        if record is not None and cleared:
            life.engine_reset(record, deep=True)
        return cleared

    return clear_prefix_cache


# -- EngineCore (the event-loop thread, and whoever builds or closes it) -------------------


def engine_init(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def __init__(engine: Any, *args: Any, **kwargs: Any) -> None:
        original(engine, *args, **kwargs)
        life.safe(_engine_built, life, engine)

    return __init__


def _engine_built(life: Lifecycle, engine: Any) -> None:
    scheduler = engine.scheduler
    life.name_engine(scheduler, str(engine.engine_id))
    record = life.engine(scheduler)
    clear_s = float(getattr(engine, "_idle_cache_clear_seconds", 0) or 0)
    if clear_s > 0:
        import logging

        logging.getLogger(__name__).warning(
            "mlx-recovery: engine %s runs with --idle-cache-clear-seconds %.0f: rapid-mlx empties "
            "its prefix cache after that long idle, and with it every prefix recovery "
            "published; recovery still runs, but only turns that come back sooner gain",
            record.engine_id, clear_s,
        )


def engine_add_request(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Reports the arrival before the request queues for the mlx-step thread, which may
    be running an idle slice that must yield to it."""
    signature = inspect.signature(original)

    async def add_request(engine: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(engine, "scheduler", None)
        try:
            bound = signature.bind(engine, *args, **kwargs)
        except TypeError:
            bound = None  # rapid-mlx reports the bad call itself
        if bound is None or scheduler is None:
            return await original(engine, *args, **kwargs)
        if bound.arguments.get("request_id") is None:
            bound.arguments["request_id"] = str(uuid.uuid4())  # EngineCore's own kind of id
        rid = bound.arguments["request_id"]
        record = life.safe(life.engine, scheduler)
        reported = False
        if record is not None:
            reported = bool(life.safe(life.arrive, record, rid, tokens_of_prompt(bound.arguments.get("prompt")), False))
            with record.lock:
                record.pending_arrivals += 1
        try:
            return await original(*bound.args, **bound.kwargs)
        except BaseException as exc:
            if reported and rid not in getattr(scheduler, "requests", {}):
                import asyncio

                cancelled = isinstance(exc, asyncio.CancelledError)
                reason = DepartureReason.ABORTED if cancelled else DepartureReason.FAILED
                life.safe(life.depart, record, rid, reason)
            raise
        finally:
            if record is not None:
                with record.lock:
                    record.pending_arrivals -= 1

    return add_request


def engine_start(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    async def start(engine: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(engine, *args, **kwargs)
        scheduler = getattr(engine, "scheduler", None)
        if scheduler is not None:
            record = life.safe(life.engine, scheduler)  # re-attaches an engine started again
            if record is not None:
                life.safe(_give_waker, record, engine)
        return result

    return start


def _give_waker(record: Any, engine: Any) -> None:
    """Let the idle driver wake the engine loop's idle wait from any thread."""
    import asyncio

    loop = asyncio.get_running_loop()

    def wake() -> None:
        event = getattr(engine, "_idle_event", None)
        if event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    record.driver.waker = wake


def engine_stop(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    async def stop(engine: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(engine, "scheduler", None)
        record = life.get(scheduler) if scheduler is not None else None
        if record is not None and life.safe(life.detach, record):
            life.engine_shutdown(record)
        return await original(engine, *args, **kwargs)

    return stop


def engine_close(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Model unloads (``BatchedEngine.stop``, the idle-unload lifecycle) reach here."""

    def close(engine: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(engine, "scheduler", None)
        record = life.get(scheduler) if scheduler is not None else None
        if record is not None and not getattr(engine, "_closed", False):
            if life.safe(life.detach, record):
                life.engine_shutdown(record)
            life.model_unloaded(record)
        return original(engine, *args, **kwargs)

    return close


FACTORIES: dict[tuple[str, str], Factory] = {
    ("Scheduler", "add_request"): scheduler_add_request,
    ("Scheduler", "has_requests"): scheduler_has_requests,
    ("Scheduler", "step"): scheduler_step,
    ("Scheduler", "_schedule_waiting"): scheduler_schedule_waiting,
    ("Scheduler", "_cleanup_finished"): scheduler_cleanup_finished,
    ("Scheduler", "_do_abort_request"): scheduler_do_abort_request,
    ("Scheduler", "_recover_from_generation_error"): scheduler_recover_from_generation_error,
    ("Scheduler", "_recover_from_cache_error"): _resetting(True),
    ("Scheduler", "reset"): _resetting(True),
    ("Scheduler", "deep_reset"): scheduler_deep_reset,
    ("Scheduler", "clear_prefix_cache"): scheduler_clear_prefix_cache,
    ("EngineCore", "__init__"): engine_init,
    ("EngineCore", "add_request"): engine_add_request,
    ("EngineCore", "start"): engine_start,
    ("EngineCore", "stop"): engine_stop,
    ("EngineCore", "close"): engine_close,
}
