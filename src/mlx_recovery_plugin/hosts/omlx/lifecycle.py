"""The adapter's bookkeeping of oMLX engines and requests, and the hook calls it makes.

The wrappers (:mod:`.wrappers`) tell a :class:`Lifecycle` what oMLX just did; it keeps
one :class:`EngineRecord` per scheduler (made, and ``engine_attached`` reported, on first
sight) with the requests the plugins were told about, so that every arrival is reported
once and is matched by exactly one departure, whichever oMLX path removed the request.

The engine table, the request balance and the hook calls both hosts make alike are
:class:`~..records.EngineBook`'s; what is oMLX's own here is what its queues mean
(``prefilling`` counts as admitted and busy), its sparse route, and the abort-all notice.

Threads: wrappers call in on whatever thread oMLX runs the method on. The engine table is
guarded by ``_lock``, each record by its own ``lock``; hooks are called outside both.
``aborted_all_pending`` is set on the event-loop thread and cleared on the engine thread.
Nothing here raises into oMLX: :meth:`Lifecycle.safe` logs the adapter's own faults once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...events import DepartureReason, RequestAdmitted, RequestPrefilled, Route, SparseRouteServed
from ..prefill_shares import admission_shares
from ..records import EngineBook, LiveRequest, door_tokens, tokens_of_prompt, tokens_of_request
from ..records import EngineRecord as _EngineRecord
from .idle_driver import IdleDriver
from .members import FLYTO_MLX, Member

if TYPE_CHECKING:  # it pulls pluggy in; the start-up hook loads this module before oMLX
    from ...plugins import HookEmitter

__all__ = ["EngineRecord", "Lifecycle", "LiveRequest", "door_tokens", "sparse_route_settings", "tokens_of_prompt", "tokens_of_request"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineRecord(_EngineRecord):
    """The adapter's view of one oMLX engine (``port``: its :class:`~.ports.OmlxEngine`,
    ``driver``: its :class:`~.idle_driver.IdleDriver`). Fields below ``lock`` are guarded
    by it, except ``aborted_all_pending``: a flag the event-loop thread sets and the engine
    thread clears."""

    aborted_all_pending: bool = False
    last_step_error: str | None = None


class Lifecycle(EngineBook):
    """Engines, requests and hook emission for one instrumentation of oMLX."""

    log = log
    fault_format = "mlx-recovery: oMLX adapter error in %s: %r"

    def __init__(
        self,
        emitter: HookEmitter,
        clock: Callable[[], float],
        accept: Callable[[Any], bool] | None = None,
        member: Member = FLYTO_MLX,
    ) -> None:
        super().__init__(emitter, clock, accept)
        #: The family member whose scheduler this instrumentation wraps.
        self.member = member

    # -- engines -----------------------------------------------------------------------

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

    def _log_attached(self, record: EngineRecord) -> None:
        port = record.port
        log.info(
            "mlx-recovery: engine %s attached (model %s, block %d tokens, prefix cache %s)",
            record.engine_id,
            port.model_id,
            port.block_size,
            "on" if port.prefix_cache.enabled else "off: nothing can be recovered",
        )

    # -- requests ----------------------------------------------------------------------

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

    def admission_began(self) -> tuple[float, float]:
        """The call's start on the adapter's clock and on oMLX's (``time.monotonic``, the
        one it stamps ``generation_started_at`` with)."""
        return self._clock(), time.monotonic()

    def admitted(self, record: EngineRecord, scheduler: Any, before: list[str], began: Any = None) -> None:
        """Report the requests of ``before`` (waiting a moment ago) now running or
        prefilling, and charge each prefill the call made its own part of it.

        oMLX prefills the requests it admits one after another inside this call and
        stamps each as it joins ``running``; from those stamps each is charged its own
        seconds, and the call is nobody else's (prefills in flight before it, chunked
        ones, do not move during it). A request that joined ``prefilling`` here (chunked
        mode) ran its first chunk in the call and has no stamp: it shares the stretch it
        ran in with the next stamped one, by tokens. Without usable stamps the call is
        split evenly among the requests it admitted."""
        if not before:
            return
        now = self._clock()
        host_end = time.monotonic()
        began_at, host_began = began if isinstance(began, tuple) else (began, None)
        if began_at is None:
            began_at = now
        prefilling = {r.request_id for r in scheduler.prefilling}
        waiting_before = set(before)
        new: list[tuple[str, int]] = []
        # In the order the host took them: (live, its stamp, tokens it ran here, finished).
        taken: list[tuple[LiveRequest, float | None, float, bool]] = []
        chunk = int(getattr(getattr(scheduler, "config", None), "prefill_step_size", 0) or 0)
        with record.lock:
            for rid, live in record.live.items():
                # A chunked prefill that completed before this call, at the step's start.
                if rid not in waiting_before and rid in scheduler.running and live.first_token_at is None:
                    record.mark_prefill_done(live, began_at)
            for rid in before:
                if rid not in scheduler.running and rid not in prefilling:
                    continue
                live = record.live.get(rid)
                if live is None or live.admitted:
                    continue
                record.mark_admitted(live, began_at)
                request = scheduler.requests.get(rid)
                cached = int(getattr(request, "cached_tokens", 0) or 0)
                new.append((rid, cached))
                tokens = float(max(0, int(getattr(request, "num_prompt_tokens", 0) or 0) - cached))
                if rid in prefilling:  # chunked: its first chunk ran here
                    taken.append((live, None, float(min(chunk, tokens)) if chunk > 0 else tokens, False))
                else:
                    stamp = getattr(scheduler.running.get(rid), "generation_started_at", None)
                    taken.append((live, float(stamp) if isinstance(stamp, (int, float)) else None, tokens, True))
            self._charge_call(record, taken, began_at, now, host_began, host_end)
        for rid, cached in new:
            self.emitter.request_admitted(
                RequestAdmitted(engine_id=record.engine_id, request_id=rid, cached_tokens=cached),
            )

    @staticmethod
    def _charge_call(
        record: EngineRecord,
        taken: list[tuple[LiveRequest, float | None, float, bool]],
        began_at: float,
        now: float,
        host_began: float | None,
        host_end: float,
    ) -> None:
        """The call's seconds go to the prefills it admitted and to nobody else (under
        ``lock``): a finished one's becomes its share, a chunked one's is counted as if
        it had been in flight that long before the call."""
        if not taken:
            return
        call_s = max(0.0, now - began_at)
        shares = None
        if host_began is not None and all(stamp is not None for _, stamp, _, done in taken if done):
            shares = admission_shares(call_s, host_began, host_end, [(s, t) for _, s, t, _ in taken])
        if shares is None:
            shares = [call_s / len(taken)] * len(taken)
        for (live, _, _, done), share in zip(taken, shares, strict=True):
            if done:
                live.share_s = share
            elif live.share_from is not None:
                live.share_from -= share  # admitted at the call's start: its share so far
        # The finished ones are out of flight now; the call was theirs alone.
        record.shares.skip(began_at, now, record.prefills_in_flight())

    def sparse_served(self, record: EngineRecord, scheduler: Any, request_id: str) -> SparseRouteServed | None:
        """The event for a running request whose prompt the sparse route served, else None."""
        request = scheduler.running.get(request_id)
        if request is None or not took_sparse_route(request):
            return None  # not sparse, or its sparse prefill never completed
        tokens = tuple(int(t) for t in (request.prompt_token_ids or ()))
        start = min(int(getattr(request, "cached_tokens", 0) or 0), len(tokens))
        threshold, keep = sparse_route_settings(request, self.member)
        with record.lock:
            # It may have finished in the step that made its first token.
            seen = record.seen_prefilled(request_id, self._clock())
        prefill_s = seen.prefill_seconds() if seen is not None else None
        return SparseRouteServed(
            engine_id=record.engine_id,
            request_id=request_id,
            model_id=record.port.model_id,
            tokens=tokens,
            served_start=start,
            served_end=len(tokens),
            threshold=threshold,
            keep=keep,
            prefill_s=prefill_s,
            keyed_beyond_tokens=bool(getattr(request, "vlm_extra_keys_for_cache", None)),
            door_s=seen.door_s if seen is not None else None,
        )

    def prefill_event(self, record: EngineRecord, scheduler: Any, request_id: str, live: LiveRequest) -> RequestPrefilled | None:
        request = scheduler.running.get(request_id) or scheduler.requests.get(request_id)
        sparse = request is not None and took_sparse_route(request)
        prefill_s = live.prefill_seconds()
        if request is None or prefill_s is None:
            return None
        return RequestPrefilled(
            engine_id=record.engine_id,
            request_id=request_id,
            model_id=record.port.model_id,
            tokens=tuple(int(t) for t in (getattr(request, "prompt_token_ids", None) or ())),
            cached_tokens=int(getattr(request, "cached_tokens", 0) or 0),
            route=Route.SPARSE if sparse else Route.DENSE,
            prefill_s=prefill_s,
        )

    # -- steps -------------------------------------------------------------------------

    def deliver_notices(self, record: EngineRecord) -> None:
        """Report, on the engine thread, what other threads noted for it."""
        if record.aborted_all_pending:
            record.aborted_all_pending = False
            self.engine_aborted_all(record)

    def idle_now(self, record: EngineRecord, scheduler: Any) -> bool:
        if scheduler.waiting or scheduler.prefilling or scheduler.running:
            return False
        if record.pending_arrivals > 0 or not record.attached:
            return False
        return record.driver.wants_step()

    # -- hook calls oMLX's own (the others are EngineBook's) -----------------------------

    def engine_aborted_all(self, record: EngineRecord) -> None:
        self.emitter.engine_aborted_all(record.engine_id)


def took_sparse_route(request: Any) -> bool:
    """oMLX's sparse route served ``request`` (its sparse prefill completed)."""
    return getattr(request, "specprefill_indices", None) is not None


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
