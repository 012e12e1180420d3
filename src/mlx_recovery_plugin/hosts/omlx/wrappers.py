"""The wrappers that replace oMLX methods while the adapter is attached.

Each factory takes the :class:`~.lifecycle.Lifecycle` and the original function and
returns a function with the same call signature that runs the original unchanged and
tells the lifecycle what happened. The original's exceptions pass through untouched; the
adapter's own faults are logged by ``Lifecycle.safe``. :data:`FACTORIES` lists them by
``(class name, method name)``.

Which hook each method becomes, and on which thread, is tabled in :mod:`.instrumentor`.

The factories whose methods mean the same on both hosts are :mod:`..wrapping`'s; this
table takes them alongside its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...events import DepartureReason
from .. import wrapping
from .lifecycle import Lifecycle, door_tokens, tokens_of_request

Fn = Callable[..., Any]
#: ``(lifecycle, original, originals by "Class.method") -> wrapper``
Factory = Callable[[Lifecycle, Fn, Mapping[str, Fn]], Fn]

FAILED_ALL_ERROR = "oMLX failed every request after a step raised"


# -- Scheduler (every method runs on the engine thread) -----------------------------------


def scheduler_add_request(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def add_request(scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.safe(life.engine, scheduler)
        rid = getattr(request, "request_id", None)
        reported = False
        if record is not None and rid is not None:
            reported = bool(life.safe(life.arrive, record, rid, tokens_of_request(request), False))
            # Before the host's own lookup, so what a plugin stores now is restored by it.
            life.safe(life.lookup_due, record, rid, door_tokens(scheduler, request))
        began = life.now()
        try:
            result = original(scheduler, request, *args, **kwargs)
        except BaseException:
            # Only an arrival this call reported: one reported at EngineCore's door departs
            # there (rapid-mlx's refusal departs here either way; kept apart on purpose).
            if reported:
                life.safe(life.depart, record, rid, DepartureReason.FAILED)
            raise
        if record is not None and rid is not None:
            life.safe(life.arrive, record, rid, (), True)
            life.safe(life.note_door, record, rid, life.now() - began)
        return result

    return add_request


def scheduler_has_requests(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """Also "yes" while an idle step is wanted: oMLX's engine loop then calls ``step()``.
    Runs on the event-loop thread, every millisecond of an idle engine: reads only."""

    def has_requests(scheduler: Any) -> bool:
        if original(scheduler):
            return True
        record = life.get(scheduler)
        if record is None:
            return False
        try:
            return record.aborted_all_pending or record.driver.wants_step()
        except Exception:  # noqa: BLE001
            return False

    return has_requests


def scheduler_step(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    host_has_requests = originals["Scheduler.has_requests"]
    output_type = life.member.resolve(life.member.scheduler_output)  # what an idle step returns
    buffer_lock = life.member.host_buffer_lock()

    def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is None:
            return original(scheduler, *args, **kwargs)
        life.safe(life.deliver_notices, record)
        real_work = bool(scheduler.waiting or scheduler.prefilling or scheduler.running)
        # An idle step only where oMLX itself would not step at all (its deferred cache
        # clears and queued aborts are real steps).
        if real_work or scheduler._pending_abort_ids or host_has_requests(scheduler):
            record.port.stepping = True
            try:
                output = original(scheduler, *args, **kwargs)
            except Exception as exc:
                record.last_step_error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                record.port.stepping = False
            life.safe(life.after_step, record, scheduler, real_work)
            return output
        if life.safe(life.idle_now, record, scheduler):
            record.driver.run_idle_step(
                record.engine_id,
                getattr(scheduler, "_stream", None),
                life.emitter.engine_idle_step,
                guard=buffer_lock,
            )
        return output_type()

    return step


def scheduler_fail_all_requests(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def fail_all_requests(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        failed = original(scheduler, *args, **kwargs)
        record = life.get(scheduler)
        if record is not None:
            error, record.last_step_error = record.last_step_error or FAILED_ALL_ERROR, None
            life.emitter.engine_failed_all(record.engine_id, error)
            for rid in list(failed or ()):
                life.safe(life.depart, record, rid, DepartureReason.FAILED)
            life.safe(life.sweep, record, scheduler, DepartureReason.FAILED)
        return failed

    return fail_all_requests


# oMLX's reset() keeps the model: a shallow reset for the plugins.
scheduler_reset = wrapping.resetting(deep=False)


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
            if record is not None:
                record.driver.stop()  # no model and no cache any more: no idle steps

    return deep_reset


def scheduler_shutdown(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    def shutdown(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is not None and life.safe(life.detach, record):
            life.emitter.engine_shutdown(record.engine_id)
        return original(scheduler, *args, **kwargs)

    return shutdown


def scheduler_recover_from_cache_error(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    """oMLX clears its prefix cache after a corrupted step: a reset, for the plugins."""

    def _recover_from_cache_error(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        record = life.get(scheduler)
        if record is not None:
            life.emitter.engine_reset(record.engine_id, False)
        return original(scheduler, *args, **kwargs)

    return _recover_from_cache_error


# -- EngineCore (the event-loop thread, and the thread that builds or closes it) -----------


def _engine_built(life: Lifecycle, engine: Any) -> None:
    life.name_engine(engine.scheduler, engine.engine_id)
    life.engine(engine.scheduler)


def engine_abort_all_requests(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    async def abort_all_requests(engine: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(engine, *args, **kwargs)
        scheduler = getattr(engine, "scheduler", None)
        record = life.get(scheduler) if scheduler is not None else None
        if record is not None:
            # Reported on the engine thread at its next step (has_requests says yes).
            record.aborted_all_pending = True
        return result

    return abort_all_requests


def engine_start(life: Lifecycle, original: Fn, originals: Mapping[str, Fn]) -> Fn:
    async def start(engine: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(engine, *args, **kwargs)
        scheduler = getattr(engine, "scheduler", None)
        if scheduler is not None:
            life.safe(life.engine, scheduler)  # re-attaches an engine started again
        return result

    return start


FACTORIES: dict[tuple[str, str], Factory] = {
    ("Scheduler", "add_request"): scheduler_add_request,
    ("Scheduler", "has_requests"): scheduler_has_requests,
    ("Scheduler", "step"): scheduler_step,
    ("Scheduler", "_schedule_waiting"): wrapping.scheduler_schedule_waiting,
    ("Scheduler", "_cleanup_finished"): wrapping.scheduler_cleanup_finished,
    ("Scheduler", "_do_abort_request"): wrapping.scheduler_do_abort_request,
    ("Scheduler", "fail_all_requests"): scheduler_fail_all_requests,
    ("Scheduler", "reset"): scheduler_reset,
    ("Scheduler", "deep_reset"): scheduler_deep_reset,
    ("Scheduler", "shutdown"): scheduler_shutdown,
    ("Scheduler", "_recover_from_cache_error"): scheduler_recover_from_cache_error,
    ("EngineCore", "__init__"): wrapping.engine_init(_engine_built),
    ("EngineCore", "add_request"): wrapping.engine_add_request,
    ("EngineCore", "abort_all_requests"): engine_abort_all_requests,
    ("EngineCore", "start"): engine_start,
    ("EngineCore", "stop"): wrapping.engine_stop,
    ("EngineCore", "close"): wrapping.engine_close,
}
