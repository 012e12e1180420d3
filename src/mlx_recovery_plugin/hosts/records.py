"""Per-engine records and the arrival/departure balance both host adapters keep.

A host's lifecycle (:mod:`.omlx.lifecycle`, :mod:`.rapid.lifecycle`) subclasses
:class:`EngineBook`: one :class:`EngineRecord` per scheduler (made, and
``engine_attached`` reported, on first sight) with the requests the plugins were told
about, so that every arrival is reported once and matched by exactly one departure,
whichever host path removed the request. Hooks are called through the
:class:`~..plugins.HookEmitter` (``book.emitter``) where each event happens: here for
attach, arrival and departure, in the wrappers for the rest. What a host's queues and methods mean (which
requests count as admitted, gone, sparse-served, idle) stays in the subclass.

Threads: the wrappers call in on whatever thread the host runs the method on. The engine
table (``_records``, ``_engine_ids``) is guarded by ``_lock``, each record's fields below
its ``lock`` by that lock; hooks are called outside both. Nothing here raises into the
host: :meth:`EngineBook.safe` logs the adapter's own faults once. Importing this module
imports no host, MLX or pluggy (the emitter comes in from the instrumentor).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..events import DepartureReason, LookupDue, RequestArrived, RequestDeparted, RequestPrefilled
from .prefill_shares import PrefillShares

if TYPE_CHECKING:
    from ..plugins import HookEmitter


@dataclass(slots=True)
class LiveRequest:
    """A request the plugins were told about; ``in_scheduler``: the host's scheduler has
    it (an arrival reported at ``EngineCore``'s door may still wait for the step thread)."""

    in_scheduler: bool = False
    admitted: bool = False
    arrived_at: float | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    #: Seconds the host spent inside its scheduler's ``add_request`` for it (oMLX scores
    #: a sparse prompt with its draft there, and restores a cached prefix, before the
    #: request queues).
    door_s: float = 0.0
    #: The engine's :class:`PrefillShares` clock at its admission, and its share of the
    #: host's time from there to its first token (None: not admitted, or not there yet).
    share_from: float | None = None
    share_s: float | None = None

    def prefill_began(self) -> float | None:
        """When its prefill began: its admission, else (not seen) its arrival."""
        return self.admitted_at if self.admitted_at is not None else self.arrived_at

    def prefill_seconds(self) -> float | None:
        """Its prefill's own time, without the wait behind other requests nor the steps
        it shared with other prefills: its share of the host's time from admission to the
        first token, plus the host's work for it at the door (oMLX scores a sparse prompt
        there, and fetches and rebuilds a cached prefix: a dense turn over a restored
        prefix pays that too). A request whose admission was not seen is timed from its
        arrival, the wait included."""
        if self.first_token_at is None:
            return None
        if self.admitted_at is None:
            return None if self.arrived_at is None else max(0.0, self.first_token_at - self.arrived_at)
        share = self.share_s if self.share_s is not None else self.first_token_at - self.admitted_at
        return max(0.0, share + self.door_s)


@dataclass(slots=True)
class EngineRecord:
    """The adapter's view of one host engine. Fields below ``lock`` are guarded by it."""

    engine_id: str
    port: Any
    driver: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, LiveRequest] = field(default_factory=dict)
    pending_arrivals: int = 0
    attached: bool = False
    shares: PrefillShares = field(default_factory=PrefillShares)

    def prefills_in_flight(self) -> int:
        """Admitted requests whose first token has not come (under ``lock``)."""
        return sum(1 for live in self.live.values() if live.share_from is not None and live.share_s is None)

    def share_clock(self, now: float) -> float:
        """The prefill-share clock at ``now`` (under ``lock``, before any change at ``now``)."""
        return self.shares.read(now, self.prefills_in_flight())

    def mark_admitted(self, live: LiveRequest, at: float) -> None:
        """``live``'s prefill began at ``at`` (under ``lock``)."""
        live.admitted, live.admitted_at = True, at
        live.share_from = self.share_clock(at)

    def mark_prefill_done(self, live: LiveRequest, at: float) -> None:
        """``live``'s prefill ended at ``at``, before its first token (under ``lock``):
        the steps until that token (another request's admission among them) are not its."""
        if live.share_from is not None and live.share_s is None:
            live.share_s = max(0.0, self.share_clock(at) - live.share_from)

    def mark_first_token(self, live: LiveRequest, now: float) -> None:
        """``live``'s first token came at ``now`` (under ``lock``)."""
        live.first_token_at = now
        self.mark_prefill_done(live, now)

    def seen_prefilled(self, request_id: str, now: float) -> LiveRequest | None:
        """A copy of the request's record with its prefill ended at ``now`` if its first
        token has not been seen (it finished in that step); the live one is unchanged
        (under ``lock``)."""
        live = self.live.get(request_id)
        if live is None:
            return None
        seen = replace(live)
        if seen.first_token_at is None:
            seen.first_token_at = now
            self.mark_prefill_done(seen, now)
        return seen


class EngineBook:
    """Engines, the request balance, and the hook calls every host makes alike."""

    #: The host module's logger, and its line for the adapter's own faults (key, error).
    log: ClassVar[logging.Logger] = logging.getLogger(__name__)
    fault_format: ClassVar[str] = "mlx-recovery: host adapter error in %s: %r"

    def __init__(
        self,
        emitter: HookEmitter,
        clock: Callable[[], float],
        accept: Callable[[Any], bool] | None = None,
    ) -> None:
        self.emitter = emitter
        self._clock = clock
        self._accept = accept
        self._lock = threading.Lock()
        self._records: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._engine_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._counter = itertools.count(1)
        self._reported: set[str] = set()
        #: Per-thread flags the wrappers set (e.g. inside ``deep_reset``).
        self.local = threading.local()

    # -- what each host says for itself --------------------------------------------------

    def _new_record(self, scheduler: Any) -> Any:
        """A record (with the host's port and idle driver) for a scheduler first seen."""
        raise NotImplementedError

    def _log_attached(self, record: Any) -> None:
        """Log, once attached, what the engine offers recovery."""

    def prefill_event(self, record: Any, scheduler: Any, request_id: str, live: LiveRequest) -> RequestPrefilled | None:
        """The ``request_prefilled`` event of a request whose first token just came (None:
        this host does not say)."""
        return None

    def now(self) -> float:
        """The adapter's clock (the one every request time is read on)."""
        return self._clock()

    def admission_began(self) -> Any:
        """What :meth:`admitted` is told of when an admission call began: the adapter's
        clock here; a host that stamps its prefills reads its own clock too."""
        return self._clock()

    # -- engines -----------------------------------------------------------------------

    def get(self, scheduler: Any) -> Any:
        """The record of a scheduler already seen (never makes one)."""
        return self._records.get(scheduler)

    def records(self) -> list[Any]:
        with self._lock:
            return list(self._records.values())

    def name_engine(self, scheduler: Any, engine_id: str) -> None:
        """Use ``EngineCore``'s id for this scheduler (called before it is first seen)."""
        with self._lock:
            self._engine_ids[scheduler] = engine_id

    def engine(self, scheduler: Any) -> Any:
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

    def attach(self, record: EngineRecord) -> None:
        with record.lock:
            if record.attached:
                return
            record.attached = True
        record.driver.resume()
        record.driver.wake()
        self._log_attached(record)
        self.emitter.engine_attached(record.port)

    def detach(self, record: EngineRecord) -> bool:
        """Mark the engine gone (no idle steps); True if it was attached."""
        record.driver.stop()
        with record.lock:
            was, record.attached = record.attached, False
        return was

    def forget_all(self) -> list[Any]:
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

    def lookup_due(self, record: EngineRecord, request_id: str, prompt_tokens: Callable[[], tuple[int, ...]]) -> None:
        """The host's scheduler is about to look ``request_id``'s prompt up in its prefix
        cache (engine thread)."""
        self.emitter.prefix_lookup_due(
            LookupDue(engine_id=record.engine_id, request_id=request_id, model_id=record.port.model_id,
                      prompt_tokens=prompt_tokens),
        )

    def note_door(self, record: EngineRecord, request_id: str, seconds: float) -> None:
        """The host's scheduler spent ``seconds`` taking ``request_id`` in."""
        now = self._clock()
        with record.lock:
            # The door ran on the step thread: no prefill in flight advanced meanwhile.
            record.shares.skip(now - max(0.0, seconds), now, record.prefills_in_flight())
            live = record.live.get(request_id)
            if live is not None:
                live.door_s += max(0.0, seconds)

    def depart(self, record: EngineRecord, request_id: str, reason: DepartureReason) -> None:
        """Report a departure of a request that arrived and has not departed yet."""
        now = self._clock()
        with record.lock:
            if request_id not in record.live:
                return
            record.share_clock(now)  # its share of the time so far, before it leaves the count
            del record.live[request_id]
        self.emitter.request_departed(
            RequestDeparted(engine_id=record.engine_id, request_id=request_id, reason=reason),
        )

    def note_first_tokens(self, record: EngineRecord, scheduler: Any) -> None:
        """Time the first token of each admitted request (its prefill's end), from the
        scheduler's ``running`` table."""
        with record.lock:
            waiting = [rid for rid, live in record.live.items() if live.admitted and live.first_token_at is None]
        if not waiting:
            return
        now = self._clock()
        prefilled = []
        for rid in waiting:
            request = scheduler.running.get(rid)
            if request is None or not getattr(request, "output_token_ids", None):
                continue
            with record.lock:
                live = record.live.get(rid)
                if live is not None and live.first_token_at is None:
                    record.mark_first_token(live, now)
                    prefilled.append((rid, replace(live)))  # a copy: read outside the lock
        for rid, seen in prefilled:
            event = self.safe(self.prefill_event, record, scheduler, rid, seen)
            if event is not None:
                self.emitter.request_prefilled(event)

    def sweep(self, record: Any, scheduler: Any, reason: DepartureReason) -> None:
        """Report departures the host made without a method of its own."""
        raise NotImplementedError

    # -- steps -------------------------------------------------------------------------

    def after_step(self, record: EngineRecord, scheduler: Any, real_work: bool) -> None:
        if real_work:
            record.driver.note_work()
            self.note_first_tokens(record, scheduler)
        self.sweep(record, scheduler, DepartureReason.FAILED)

    def safe(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the adapter's own bookkeeping; a fault there is logged once, never raised
        into the host, and reads as None."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            key = f"{getattr(fn, '__name__', fn)}:{type(exc).__name__}"
            if key not in self._reported:
                self._reported.add(key)
                self.log.error(self.fault_format, key, exc, exc_info=exc)
            return None


def tokens_of_request(request: Any) -> tuple[int, ...]:
    ids = getattr(request, "prompt_token_ids", None)
    return tokens_of_prompt(getattr(request, "prompt", None) if ids is None else ids)


def door_tokens(scheduler: Any, request: Any) -> Callable[[], tuple[int, ...]]:
    """The request's prompt tokens, for a plugin that asks at the host's door: its ids
    when it has them, else its text through the scheduler's own tokenizer, as the host's
    ``add_request`` itself is about to tokenize it (once per call; nothing is written to
    the request)."""

    def tokens() -> tuple[int, ...]:
        ids = getattr(request, "prompt_token_ids", None)
        if ids is not None:
            return tuple(ids)
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, str):
            # rapid-mlx tokenizes through its own helper; oMLX through its tokenizer.
            encode = getattr(scheduler, "_encode_prompt_string", None) or scheduler.tokenizer.encode
            return tuple(encode(prompt))
        return tokens_of_prompt(prompt)

    return tokens


def tokens_of_prompt(prompt: Any) -> tuple[int, ...]:
    """Token ids when the prompt already is a list of them; a text prompt is not tokenized
    here (the arrival hook must stay cheap), so it reports no tokens."""
    return tuple(prompt) if isinstance(prompt, (list, tuple)) else ()
