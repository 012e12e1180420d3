"""The adapter's bookkeeping of oMLX engines and requests, and the hook calls it makes.

The wrappers (:mod:`.wrappers`) tell a :class:`Lifecycle` what oMLX just did; it keeps
one :class:`EngineRecord` per scheduler (made, and ``engine_attached`` reported, on first
sight) with the requests the plugins were told about, so that every arrival is reported
once and is matched by exactly one departure, whichever oMLX path removed the request.

Threads: wrappers call in on whatever thread oMLX runs the method on. The engine table is
guarded by ``_lock``, each record by its own ``lock``; hooks are called outside both.
Nothing here raises into oMLX: :meth:`Lifecycle.safe` logs the adapter's own faults once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...events import (
    DepartureReason,
    IdleStep,
    RequestAdmitted,
    RequestArrived,
    RequestDeparted,
    SparseRouteServed,
)
from .idle_driver import IdleDriver
from .members import FLYTO_MLX, Member

if TYPE_CHECKING:  # both pull MLX in; the start-up hook loads this module before oMLX
    from ...plugins import HookEmitter
    from .ports import OmlxEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LiveRequest:
    """A request the plugins were told about; ``in_scheduler``: oMLX's scheduler has it
    (an arrival reported at ``EngineCore``'s door may still wait for the engine thread)."""

    in_scheduler: bool = False
    admitted: bool = False
    arrived_at: float | None = None
    first_token_at: float | None = None


@dataclass(slots=True)
class EngineRecord:
    """The adapter's view of one oMLX engine. Fields below ``lock`` are guarded by it."""

    engine_id: str
    port: OmlxEngine
    driver: IdleDriver
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, LiveRequest] = field(default_factory=dict)
    pending_arrivals: int = 0
    attached: bool = False
    aborted_all_pending: bool = False
    last_step_error: str | None = None


class Lifecycle:
    """Engines, requests and hook emission for one instrumentation of oMLX."""

    def __init__(
        self,
        emitter: HookEmitter,
        clock: Callable[[], float],
        accept: Callable[[Any], bool] | None = None,
        member: Member = FLYTO_MLX,
    ) -> None:
        self.emitter = emitter
        #: The family member whose scheduler this instrumentation wraps.
        self.member = member
        self._clock = clock
        self._accept = accept
        self._lock = threading.Lock()
        self._records: weakref.WeakKeyDictionary[Any, EngineRecord] = weakref.WeakKeyDictionary()
        self._engine_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._counter = itertools.count(1)
        self._reported: set[str] = set()
        #: Per-thread flag: inside ``deep_reset`` (whose own ``reset()`` is not reported).
        self.local = threading.local()

    # -- engines -----------------------------------------------------------------------

    def get(self, scheduler: Any) -> EngineRecord | None:
        """The record of a scheduler already seen (never makes one)."""
        return self._records.get(scheduler)

    def records(self) -> list[EngineRecord]:
        with self._lock:
            return list(self._records.values())

    def name_engine(self, scheduler: Any, engine_id: str) -> None:
        """Use ``EngineCore``'s id for this scheduler (called before it is first seen)."""
        with self._lock:
            self._engine_ids[scheduler] = engine_id

    def engine(self, scheduler: Any) -> EngineRecord | None:
        """The scheduler's record, made and attached on first sight (and re-attached after
        a stop); None for a scheduler the adapter was told to leave alone."""
        record = self._records.get(scheduler)
        if record is None:
            if self._accept is not None and not self._accept(scheduler):
                return None
            with self._lock:
                record = self._records.get(scheduler)
                if record is None:
                    record = self._new_record(scheduler)
                    self._records[scheduler] = record
        if not record.attached:
            self.attach(record)
        return record

    def _new_record(self, scheduler: Any) -> EngineRecord:
        from .ports import OmlxEngine, model_id_of

        engine_id = self._engine_ids.get(scheduler) or (
            f"{self.member.name}-{model_id_of(scheduler)}-{next(self._counter)}"
        )
        box: list[EngineRecord] = []
        port = OmlxEngine(
            scheduler, engine_id, pending_arrivals=lambda: box[0].pending_arrivals, member=self.member
        )
        record = EngineRecord(engine_id, port, IdleDriver(self._clock))
        box.append(record)
        return record

    def attach(self, record: EngineRecord) -> None:
        with record.lock:
            if record.attached:
                return
            record.attached = True
        record.driver.resume()
        record.driver.wake()
        port = record.port
        log.info(
            "mlx-recovery: engine %s attached (model %s, block %d tokens, prefix cache %s)",
            record.engine_id,
            port.model_id,
            port.block_size,
            "on" if port.prefix_cache.enabled else "off: nothing can be recovered",
        )
        self.emitter.engine_attached(port)

    def detach(self, record: EngineRecord) -> bool:
        """Mark the engine gone (no idle steps); True if it was attached."""
        record.driver.stop()
        with record.lock:
            was, record.attached = record.attached, False
        return was

    def forget_all(self) -> list[EngineRecord]:
        """Drop every record (uninstrument); returns those that were attached."""
        with self._lock:
            records = list(self._records.values())
            self._records = weakref.WeakKeyDictionary()
        return [r for r in records if self.detach(r)]

    # -- requests ----------------------------------------------------------------------

    def arrive(self, record: EngineRecord, request_id: str, tokens: tuple[int, ...], in_scheduler: bool) -> bool:
        """Report an arrival once; True if this call reported it."""
        with record.lock:
            live = record.live.get(request_id)
            if live is not None:
                live.in_scheduler = live.in_scheduler or in_scheduler
                return False
            record.live[request_id] = LiveRequest(in_scheduler=in_scheduler, arrived_at=self._clock())
        record.driver.note_work()
        self.emitter.request_arrived(
            RequestArrived(
                engine_id=record.engine_id,
                request_id=request_id,
                model_id=record.port.model_id,
                prompt_tokens=tokens,
            ),
        )
        return True

    def depart(self, record: EngineRecord, request_id: str, reason: DepartureReason) -> None:
        """Report a departure of a request that arrived and has not departed yet."""
        with record.lock:
            if record.live.pop(request_id, None) is None:
                return
        self.emitter.request_departed(
            RequestDeparted(engine_id=record.engine_id, request_id=request_id, reason=reason),
        )

    def sweep(self, record: EngineRecord, scheduler: Any, reason: DepartureReason) -> None:
        """Report departures oMLX made without a method of its own (refused admissions)."""
        with record.lock:
            gone = [
                rid
                for rid, live in record.live.items()
                if live.in_scheduler and rid not in scheduler.requests
            ]
        for rid in gone:
            self.depart(record, rid, reason)

    def admitted(self, record: EngineRecord, scheduler: Any, before: list[str]) -> None:
        """Report the requests of ``before`` (waiting a moment ago) now running or prefilling."""
        if not before:
            return
        prefilling = {r.request_id for r in scheduler.prefilling}
        for rid in before:
            if rid not in scheduler.running and rid not in prefilling:
                continue
            with record.lock:
                live = record.live.get(rid)
                if live is None or live.admitted:
                    continue
                live.admitted = True
            request = scheduler.requests.get(rid)
            cached = int(getattr(request, "cached_tokens", 0) or 0)
            self.emitter.request_admitted(
                RequestAdmitted(engine_id=record.engine_id, request_id=rid, cached_tokens=cached),
            )

    def sparse_served(self, record: EngineRecord, scheduler: Any, request_id: str) -> SparseRouteServed | None:
        """The event for a running request whose prompt the sparse route served, else None."""
        request = scheduler.running.get(request_id)
        if request is None or getattr(request, "specprefill_indices", None) is None:
            return None  # not sparse, or its sparse prefill never completed
        tokens = tuple(int(t) for t in (request.prompt_token_ids or ()))
        start = min(int(getattr(request, "cached_tokens", 0) or 0), len(tokens))
        threshold, keep = sparse_route_settings(request, self.member)
        with record.lock:
            live = record.live.get(request_id)
            began = live.arrived_at if live is not None else None
            first = live.first_token_at if live is not None else None
        if first is None:
            first = self._clock()  # it finished in the step that made its first token
        return SparseRouteServed(
            engine_id=record.engine_id,
            request_id=request_id,
            model_id=record.port.model_id,
            tokens=tokens,
            served_start=start,
            served_end=len(tokens),
            threshold=threshold,
            keep=keep,
            prefill_s=first - began if began is not None and first is not None else None,
            keyed_beyond_tokens=bool(getattr(request, "vlm_extra_keys_for_cache", None)),
        )

    # -- steps -------------------------------------------------------------------------

    def deliver_notices(self, record: EngineRecord) -> None:
        """Report, on the engine thread, what other threads noted for it."""
        if record.aborted_all_pending:
            record.aborted_all_pending = False
            self.engine_aborted_all(record)

    def after_step(self, record: EngineRecord, scheduler: Any, real_work: bool) -> None:
        if real_work:
            record.driver.note_work()
            self.note_first_tokens(record, scheduler)
        self.sweep(record, scheduler, DepartureReason.FAILED)

    def note_first_tokens(self, record: EngineRecord, scheduler: Any) -> None:
        """Time the first token of each admitted request (its prefill's end)."""
        with record.lock:
            waiting = [rid for rid, live in record.live.items() if live.admitted and live.first_token_at is None]
        if not waiting:
            return
        now = self._clock()
        for rid in waiting:
            request = scheduler.running.get(rid)
            if request is None or not getattr(request, "output_token_ids", None):
                continue
            with record.lock:
                live = record.live.get(rid)
                if live is not None and live.first_token_at is None:
                    live.first_token_at = now

    def idle_now(self, record: EngineRecord, scheduler: Any) -> bool:
        if scheduler.waiting or scheduler.prefilling or scheduler.running:
            return False
        if record.pending_arrivals > 0 or not record.attached:
            return False
        return record.driver.wants_step()

    # -- hook calls: the one place the oMLX adapter talks to plugins ---------------------
    # (arrival, admission and departure are reported by the bookkeeping methods above)

    def request_aborted(self, record: EngineRecord, request_id: str) -> None:
        self.emitter.request_aborted(record.engine_id, request_id)

    def engine_aborted_all(self, record: EngineRecord) -> None:
        self.emitter.engine_aborted_all(record.engine_id)

    def engine_failed_all(self, record: EngineRecord, error: str) -> None:
        self.emitter.engine_failed_all(record.engine_id, error)

    def engine_reset(self, record: EngineRecord, *, deep: bool) -> None:
        self.emitter.engine_reset(record.engine_id, deep)

    def engine_shutdown(self, record: EngineRecord) -> None:
        self.emitter.engine_shutdown(record.engine_id)

    def model_unloaded(self, record: EngineRecord) -> None:
        self.emitter.model_unloaded(record.engine_id, record.port.model_id)

    def engine_idle_step(self, event: IdleStep) -> list[bool | float]:
        return self.emitter.engine_idle_step(event)

    def sparse_route_served(self, event: SparseRouteServed) -> None:
        self.emitter.sparse_route_served(event)

    def safe(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the adapter's own bookkeeping; a fault there is logged once, never raised
        into oMLX, and reads as None."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            key = f"{getattr(fn, '__name__', fn)}:{type(exc).__name__}"
            if key not in self._reported:
                self._reported.add(key)
                log.error("mlx-recovery: oMLX adapter error in %s: %r", key, exc, exc_info=exc)
            return None


def sparse_route_settings(request: Any, member: Member = FLYTO_MLX) -> tuple[int | None, float | None]:
    """The threshold and keep share the host applies to ``request``'s sparse route: the
    request's own values, else the member's defaults (None where this version has none)."""
    default_threshold, default_keep = member.sparse_defaults()
    threshold = getattr(request, "_specprefill_threshold", None) or default_threshold
    keep = getattr(request, "_specprefill_keep_pct", None) or default_keep
    return (
        int(threshold) if threshold is not None else None,
        float(keep) if keep is not None else None,
    )


def tokens_of_request(request: Any) -> tuple[int, ...]:
    ids = getattr(request, "prompt_token_ids", None)
    return tokens_of_prompt(getattr(request, "prompt", None) if ids is None else ids)


def tokens_of_prompt(prompt: Any) -> tuple[int, ...]:
    """Token ids when the prompt already is a list of them; a text prompt is not tokenized
    here (the arrival hook must stay cheap), so it reports no tokens."""
    return tuple(prompt) if isinstance(prompt, (list, tuple)) else ()
