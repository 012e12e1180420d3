"""The wrappers that replace rapid-mlx methods while the adapter is attached.

Each factory takes the :class:`~.lifecycle.Lifecycle` and the original function and
returns a function with the same call signature that runs the original unchanged and
tells the lifecycle what happened. The original's exceptions pass through untouched; the
adapter's own faults are logged by ``Lifecycle.safe``. :data:`FACTORIES` lists them by
``(class name, method name)``; which hook each becomes, on which thread, is tabled in
:mod:`.instrumentor`.

The factories whose methods mean the same on both hosts are :mod:`..wrapping`'s; this
table takes them alongside its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from ...events import DepartureReason
from .. import wrapping
from .lifecycle import Lifecycle, door_tokens, tokens_of_request

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
            # Before the host's own lookup, so what a plugin stores now is restored by it.
            life.safe(life.lookup_due, record, rid, door_tokens(scheduler, request))
        began = life.now()
        try:
            result = original(scheduler, request, *args, **kwargs)
        except BaseException:
            # Refused at the door (backpressure, a bad prompt): it never queued.
            if record is not None and rid is not None:
                life.safe(life.depart, record, rid, DepartureReason.FAILED)
            raise
        if record is not None and rid is not None:
            life.safe(life.arrive, record, rid, (), True)
            life.safe(life.note_door, record, rid, life.now() - began)
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
            record.driver.run_idle_step(record.engine_id, life.emitter.engine_idle_step)
        return output_type()

    return step


def scheduler_recover_from_generation_error(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """rapid-mlx calls it from inside ``step()``'s ``except`` block: the step's error is
    the exception being handled."""

    def _recover_from_generation_error(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        handling = sys.exc_info()[1]
        failed = original(scheduler, *args, **kwargs)
        record = life.get(scheduler)
        if record is not None:
            error = f"{type(handling).__name__}: {handling}" if handling is not None else FAILED_ALL_ERROR
            life.emitter.engine_failed_all(record.engine_id, error)
            for rid in list(failed or ()):
                life.safe(life.depart, record, rid, DepartureReason.FAILED)
        return failed

    return _recover_from_generation_error


# rapid-mlx's reset() and cache-error recovery empty the prefix cache too: both are deep
# resets for the plugins.
scheduler_reset = wrapping.resetting(deep=True)


def scheduler_deep_reset(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def deep_reset(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is not None:
            life.emitter.engine_reset(record.engine_id, True)
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
            life.emitter.engine_reset(record.engine_id, True)
        return cleared

    return clear_prefix_cache


# -- EngineCore (the event-loop thread, and whoever builds or closes it) -------------------


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


FACTORIES: dict[tuple[str, str], Factory] = {
    ("Scheduler", "add_request"): scheduler_add_request,
    ("Scheduler", "has_requests"): scheduler_has_requests,
    ("Scheduler", "step"): scheduler_step,
    ("Scheduler", "_schedule_waiting"): wrapping.scheduler_schedule_waiting,
    ("Scheduler", "_cleanup_finished"): wrapping.scheduler_cleanup_finished,
    ("Scheduler", "_do_abort_request"): wrapping.scheduler_do_abort_request,
    ("Scheduler", "_recover_from_generation_error"): scheduler_recover_from_generation_error,
    ("Scheduler", "_recover_from_cache_error"): scheduler_reset,
    ("Scheduler", "reset"): scheduler_reset,
    ("Scheduler", "deep_reset"): scheduler_deep_reset,
    ("Scheduler", "clear_prefix_cache"): scheduler_clear_prefix_cache,
    ("EngineCore", "__init__"): wrapping.engine_init(_engine_built),
    ("EngineCore", "add_request"): wrapping.engine_add_request,
    ("EngineCore", "start"): engine_start,
    ("EngineCore", "stop"): wrapping.engine_stop,
    ("EngineCore", "close"): wrapping.engine_close,
}
