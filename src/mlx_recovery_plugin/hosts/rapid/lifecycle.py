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

Threads: wrappers call in on whatever thread rapid-mlx runs the method on (the
``mlx-step`` thread for the scheduler's work, the event-loop thread for ``EngineCore``'s
coroutines and ``has_requests``). The engine table is guarded by ``_lock``, each record by
its own ``lock``; hooks are called outside both. Nothing here raises into rapid-mlx:
:meth:`Lifecycle.safe` logs the adapter's own faults once.
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

if TYPE_CHECKING:
    from ...plugins import HookEmitter
    from .ports import RapidEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LiveRequest:
    """A request the plugins were told about; ``in_scheduler``: rapid-mlx's scheduler has
    it (an arrival reported at ``EngineCore``'s door may still wait for the mlx-step thread)."""

    in_scheduler: bool = False
    admitted: bool = False
    arrived_at: float | None = None
    first_token_at: float | None = None


@dataclass(slots=True)
class EngineRecord:
    """The adapter's view of one rapid-mlx engine. Fields below ``lock`` are guarded by it."""

    engine_id: str
    port: RapidEngine
    driver: IdleDriver
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, LiveRequest] = field(default_factory=dict)
    pending_arrivals: int = 0
    attached: bool = False


class Lifecycle:
    """Engines, requests and hook emission for one instrumentation of rapid-mlx."""

    def __init__(self, emitter: HookEmitter, clock: Callable[[], float], block_size: int) -> None:
        self.emitter = emitter
        self._clock = clock
        self._block_size = block_size
        self._lock = threading.Lock()
        self._records: weakref.WeakKeyDictionary[Any, EngineRecord] = weakref.WeakKeyDictionary()
        self._engine_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._counter = itertools.count(1)
        self._reported: set[str] = set()
        #: Per-thread flag: inside ``deep_reset`` (whose own ``reset()`` is not reported).
        self.local = threading.local()

    # -- engines -----------------------------------------------------------------------

    def get(self, scheduler: Any) -> EngineRecord | None:
        return self._records.get(scheduler)

    def records(self) -> list[EngineRecord]:
        with self._lock:
            return list(self._records.values())

    def name_engine(self, scheduler: Any, engine_id: str) -> None:
        with self._lock:
            self._engine_ids[scheduler] = engine_id

    def engine(self, scheduler: Any) -> EngineRecord:
        """The scheduler's record, made and attached on first sight (and re-attached
        after a stop)."""
        record = self._records.get(scheduler)
        if record is None:
            with self._lock:
                record = self._records.get(scheduler)
                if record is None:
                    record = self._new_record(scheduler)
                    self._records[scheduler] = record
        if not record.attached:
            self.attach(record)
        return record

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

    def attach(self, record: EngineRecord) -> None:
        with record.lock:
            if record.attached:
                return
            record.attached = True
        record.driver.resume()
        record.driver.wake()
        port = record.port
        log.info(
            "mlx-recovery: engine %s attached (model %s, entries published in steps of %d tokens, "
            "prefix cache %s)",
            record.engine_id, port.model_id, port.block_size,
            "memory-aware" if port.prefix_cache.enabled else "not memory-aware: nothing can be recovered",
        )
        self.emitter.engine_attached(port)

    def detach(self, record: EngineRecord) -> bool:
        """Mark the engine gone (no idle steps); True if it was attached."""
        record.driver.stop()
        with record.lock:
            was, record.attached = record.attached, False
        return was

    def forget_all(self) -> list[EngineRecord]:
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
            RequestArrived(record.engine_id, request_id, record.port.model_id, tokens)
        )
        return True

    def depart(self, record: EngineRecord, request_id: str, reason: DepartureReason) -> None:
        with record.lock:
            if record.live.pop(request_id, None) is None:
                return
        self.emitter.request_departed(RequestDeparted(record.engine_id, request_id, reason))

    def sweep(self, record: EngineRecord, scheduler: Any, reason: DepartureReason) -> None:
        """Report departures rapid-mlx made without a method of its own."""
        with record.lock:
            gone = [
                rid for rid, live in record.live.items()
                if live.in_scheduler and rid not in scheduler.running and rid not in scheduler.requests
            ]
        for rid in gone:
            self.depart(record, rid, reason)

    def admitted(self, record: EngineRecord, scheduler: Any, before: list[str]) -> None:
        """Report the requests of ``before`` (waiting a moment ago) now running."""
        for rid in before:
            request = scheduler.running.get(rid)
            if request is None:
                continue
            with record.lock:
                live = record.live.get(rid)
                if live is None or live.admitted:
                    continue
                live.admitted = True
            cached = int(getattr(request, "cached_tokens", 0) or 0)
            self.emitter.request_admitted(RequestAdmitted(record.engine_id, rid, cached))

    def note_first_tokens(self, record: EngineRecord, scheduler: Any) -> None:
        """Time the first token of each admitted request (the end of its prefill)."""
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
            live = record.live.get(request_id)
            began = live.arrived_at if live is not None else None
            first = live.first_token_at if live is not None else None
        if first is None:
            first = self._clock()
        return SparseRouteServed(
            engine_id=record.engine_id,
            request_id=request_id,
            model_id=record.port.model_id,
            tokens=tokens,
            served_start=0,  # a compressed request reuses no cached prefix
            served_end=len(tokens),
            threshold=threshold,
            keep=keep,
            prefill_s=first - began if began is not None else None,
            keyed_beyond_tokens=bool(getattr(request, "is_multimodal", False)),
        )

    # -- steps -------------------------------------------------------------------------

    def after_step(self, record: EngineRecord, scheduler: Any, real_work: bool) -> None:
        if real_work:
            record.driver.note_work()
            self.note_first_tokens(record, scheduler)
        self.sweep(record, scheduler, DepartureReason.FAILED)

    def idle_now(self, record: EngineRecord, scheduler: Any) -> bool:
        if scheduler.waiting or scheduler.running:
            return False
        if record.pending_arrivals > 0 or not record.attached:
            return False
        return record.driver.wants_step()

    # -- hook calls: the one place the rapid-mlx adapter talks to plugins ----------------

    def request_aborted(self, record: EngineRecord, request_id: str) -> None:
        self.emitter.request_aborted(record.engine_id, request_id)

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
        """Run the adapter's own bookkeeping; a fault is logged once, never raised into
        rapid-mlx, and reads as None."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            key = f"{getattr(fn, '__name__', fn)}:{type(exc).__name__}"
            if key not in self._reported:
                self._reported.add(key)
                log.error("mlx-recovery: rapid-mlx adapter error in %s: %r", key, exc, exc_info=exc)
            return None


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


def tokens_of_prompt(prompt: Any) -> tuple[int, ...]:
    """Token ids when the prompt already is a list of them; text is not tokenized here."""
    return tuple(prompt) if isinstance(prompt, (list, tuple)) else ()


def tokens_of_request(request: Any) -> tuple[int, ...]:
    ids = getattr(request, "prompt_token_ids", None)
    return tokens_of_prompt(getattr(request, "prompt", None) if ids is None else ids)
