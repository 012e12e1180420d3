"""One engine's recovery: its job book, its slice loop and the gates around each slice.

Each idle step the engine offers runs at most one slice: pick the job most likely to be
asked for again, ask the runnable gate, take the execution claim, densely prefill up to
the sizer's slice more tokens (:mod:`.live`, :mod:`.slice_size`), charge the budget, let
the publish policy judge the finished blocks (:mod:`.judge`), publish them and advance the
committed boundary only after the host's fetch path gives them back (:mod:`.publication`).
Whenever the gate says no for foreground work, the live state is retired and the job later
resumes from its committed block, fetched back from the host.

Faults never leave this module: a runner error or out-of-memory parks the job with
back-off; a store error, a probe that restores less, a failing fetch or a vanished host
drops it. Every fetch and probe reference goes through the engine's
:class:`~.ledger.ReleaseLedger`, which keeps any whose release failed until it goes
through.

Threads. The engine thread runs :meth:`EngineRecovery.idle_step`,
:meth:`EngineRecovery.served` and :meth:`EngineRecovery.foreground`; it alone touches the
live state, the ledger, the sizer and the judge, and it holds ``_work`` while it does.
Cancellation may come from any thread (shutdown, unload) through
:class:`~.cancellation.Cancellation`; the canceller then either drops the state itself
(``_work`` free) or leaves that to the engine thread when its slice returns. The job book,
the counters, ``last_refusal``, ``host_refuses`` and the return times are guarded by
``_lock``, which is only ever held briefly; :meth:`snapshot` copies them under it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..events import LookupDue, RequestPrefilled, SparseRouteServed
from ..ports import EnginePort
from ..settings import RecoverySettings, env_name
from ..state import BlockState
from .budget import Budget
from .cancellation import Cancellation
from .costs import Verdict, pass_seconds
from .host_refusal import HostRefusalWatch
from .jobs import JobBook, RecoveryJob, Relation, common_prefix_len
from .judge import PublishJudge
from .ledger import ReleaseLedger
from .live import AttentionProbe, LiveDense, RunnerFactory, Start, default_attention_probe, default_runner_factory
from .machine_load import Regime
from .outcomes import KEEP_LIVE_THROUGH, FaultKind, Refusal, runner_fault_kind
from .publication import PublicationError, publish
from .returns import ReturnTimes, due_first
from .runnable import RunnableGate, held_memory_bound, machine_memory_bytes
from .slice_size import SliceSizer
from .status import EngineCounters, EngineStatus, JobStatus, dense_fit
from .step_phases import PROBE, SETTLE, SLICE, START, VERDICT, StepPhases

if TYPE_CHECKING:
    from ..runner import SliceOutcome

__all__ = ["EngineRecovery", "RunnerFactory", "default_runner_factory"]

log = logging.getLogger(__name__)

# Ask again after this long when another engine or a request holds the process.
RETRY_S = 0.1
# Back-off after a runner fault, doubled per repeat, and the repeats before giving up.
PARK_BASE_S = 1.0
PARK_MAX_S = 60.0
PARK_MAX_ATTEMPTS = 5
# How soon a holder whose release failed is tried again on an otherwise idle engine.
RELEASE_RETRY_S = 1.0
# While the machine is loaded and a job stands down or pauses with nothing else to run,
# the engine asks for an idle step this often to read the load again: the host offers
# none after an answer of "nothing", and a stand-down taken under load would hold through
# the quiet idle time after it (bench policy, 4096x2 loaded: the quiet turn paid 2.2x).
LOAD_RECHECK_S = 5.0
# How long a cancellation from another thread waits for a running slice to stop.
CANCEL_WAIT_S = 2.0
# The job in hand (else the most recently served) yields to another only if that one's
# recovery is expected to save at least this many times as much per token of work.
CLEARLY_MORE = 2.0
# Whether the job in hand is the one to beat (the lab's order bench turns it off for its
# pure-recency arm).
FINISH_IN_HAND = True
# Whether the job due back first that can still be finished goes first (:mod:`.returns`;
# the lab's order bench turns it off for its pure-recency arm).
DUE_FIRST = True


class EngineRecovery:
    """Recovery jobs and the slice loop of one engine (see the module docstring)."""

    def __init__(
        self,
        port: EnginePort,
        *,
        settings: RecoverySettings,
        budget: Budget,
        gate: RunnableGate,
        arrivals: Callable[[], int],
        arrivals_since: Callable[[int], tuple[int, tuple[float, ...]]],
        clock: Callable[[], float],
        runner_factory: RunnerFactory = default_runner_factory,
        attention_probe: AttentionProbe | None = None,
    ) -> None:
        self.port = port
        self.engine_id = port.engine_id
        self.model_id = port.model_id
        self.block_size = int(port.block_size)
        self._budget = budget
        self._gate = gate
        self._arrivals = arrivals
        self._arrivals_since = arrivals_since
        self._clock = clock
        # Engine thread only: ``context -> seconds per token`` of the model's attention;
        # dropped for good once it says it cannot time this model, or fails.
        self._attention_probe: AttentionProbe | None = attention_probe or default_attention_probe(port.model)

        self._lock = threading.RLock()  # book, counters, last_refusal, host_refuses, _returns
        self._work = threading.RLock()  # held by the engine thread for a whole idle step
        self._cancel = Cancellation()
        self.book = JobBook(self.block_size, settings.max_jobs_per_engine)
        self.counters = EngineCounters()
        self.last_refusal: str | None = None
        #: Why recovery stopped taking jobs on this engine for good, or None.
        self.host_refuses: str | None = None

        # Engine thread only (under _work); their status figures are replaced whole.
        self.judge = PublishJudge(settings.publish_policy, self.block_size, clock=clock)
        self._sizer = SliceSizer(
            settings.slice_tokens_for(self.model_id, int(port.prefill_step)), self.block_size, budget.remaining_s,
            predict=lambda tokens, context: self.judge.costs.seconds(tokens, context),
            layer_predict=lambda tokens, context: self.judge.layer_seconds_bound(tokens, context),
        )
        # Written on the engine thread before each slice; read whole by snapshot().
        self._stop_grain: int | None = None
        # The parts of the idle step now running (engine thread only).
        self._phases = StepPhases()
        self._ledger = ReleaseLedger(self.engine_id, self._count_fault)
        self._live = LiveDense(
            port,
            self.block_size,
            runner_factory=runner_factory,
            interruptible=settings.interruptible,
            ledger=self._ledger,
            count_fault=self._count_fault,
        )
        self._refusals = HostRefusalWatch()
        # The job the last slice was for: worked on until it is done unless another saves
        # clearly more (engine thread only).
        self._in_hand: int | None = None
        # When each conversation is expected back (under _lock).
        self._returns = ReturnTimes()
        self._max_held_bytes = held_memory_bound(settings.max_held_mib, machine_memory_bytes())

    @property
    def slice_tokens(self) -> int:
        return self._sizer.slice_tokens

    @property
    def closed(self) -> bool:
        return self._cancel.closed

    # -- hooks (engine thread) -----------------------------------------------------

    def served(self, event: SparseRouteServed) -> None:
        """A sparse route served ``event``'s range: queue, extend or replace a job."""
        if self.closed:
            return
        if event.keyed_beyond_tokens or self.host_refuses is not None:
            reason = Refusal.KEYED_BEYOND_TOKENS if event.keyed_beyond_tokens else Refusal.HOST_RESTORES_NOTHING
            with self._lock:
                self.counters.refused(reason.value)
            return
        with self._lock:
            offer = self.book.offer(event.tokens, event.served_start, event.served_end)
            if offer.job is not None:
                now = self._clock()
                self.judge.note_route(offer.job, event, offer.appended, now)
                self._returns.turn(offer.job.job_id, now, event.request_id)
            known = self.book.known_ids()
            self.judge.keep_only(known)
            self._returns.keep_only(known)
            if offer.relation in (Relation.UNRELATED, Relation.FORKS):
                self.counters.jobs_queued += 1
            elif offer.relation is Relation.EXTENDS:
                self.counters.jobs_extended += 1
            self.counters.jobs_dropped += len(offer.dropped)
        live_job = self._live.job
        if live_job is not None and (live_job is offer.job or live_job in offer.dropped):
            self.foreground()

    def prefilled(self, event: RequestPrefilled) -> None:
        """The host prefilled a request: the publish policy learns what it really cost, and
        the return times that its conversation came back."""
        if self.closed or not event.tokens:
            return
        with self._lock:
            job = self.book.conversation_of(event.tokens)
            if job is not None:
                # Every turn of a known conversation, a dense one over a restored prefix too.
                self._returns.turn(job.job_id, self._clock(), event.request_id)
        self.judge.observe_turn(job, event)

    def lookup_due(self, event: LookupDue) -> None:
        """The host is about to look a request up in its prefix cache: blocks held for
        the conversation it continues are judged on its real length, and published now
        when they pay, so the lookup restores them (see ``waits_for_arrival``)."""
        if self.closed:
            return
        self.judge.note_lookup()
        with self._lock:
            holding = [job for job in self.book if job.held]
        if not holding:
            return
        tokens = event.prompt_tokens()
        # The conversation the request goes on with: the holding job it shares the most
        # with. The prompt may leave the job's tokens inside its last blocks (a chat
        # template ends a turn's prompt otherwise than the next turn goes on): the
        # blocks past where the two part cannot serve it.
        shares = [(min(common_prefix_len(job.tokens, tokens), len(tokens) - 1), job) for job in holding]
        shared, job = max(shares, key=lambda pair: pair[0])
        with self._lock:
            pending = job.pending_with([], self.block_size)
        pending = [b for b in pending if (b.index + 1) * self.block_size <= shared]
        if not pending:
            return
        boundary = (pending[-1].index + 1) * self.block_size
        if not self._work.acquire(blocking=False):
            return  # a cancellation is cleaning up
        try:
            decision = self.judge.judge(job, boundary, next_tokens=len(tokens))
            if decision.verdict is not Verdict.PUBLISH:
                return
            with self._lock:
                job.release_held()
            began = time.perf_counter()  # the request's own wait, in real time
            if self._publish(job, pending):
                with self._lock:
                    self.counters.arrival_publications += 1
                    self.counters.arrival_publish_seconds += max(0.0, time.perf_counter() - began)
                    self._complete_if_done_locked(job)
        finally:
            self._work.release()

    def foreground(self) -> None:
        """Foreground work reached this engine: give the live state's memory back now."""
        if not self._live.active:
            return
        if self._work.acquire(blocking=False):
            try:
                self._retire_live()
            finally:
                self._work.release()

    def idle_step(self, consecutive: int) -> bool | float | None:
        """Run at most one slice. True: offer another idle step now; a float: ask again
        after that many seconds; None: nothing to do. Never raises."""
        if self.closed or (len(self.book) == 0 and not self._live.active and not self._ledger.pending):
            return None
        if not self._work.acquire(blocking=False):
            return RETRY_S  # a cancellation from another thread is cleaning up
        try:
            return self._idle_step(consecutive)
        except Exception as exc:
            log.error("mlx-recovery: engine %s idle step failed: %r", self.engine_id, exc, exc_info=exc)
            self._count_fault(FaultKind.INTERNAL_ERROR)
            self._retire_live()
            return None
        finally:
            self._work.release()

    # -- cancellation (any thread) -------------------------------------------------

    def cancel(self, reason: str, *, forget: bool = False, wait_s: float = CANCEL_WAIT_S) -> None:
        """Drop every job and the live state at once. ``forget``: the engine is going
        away (shutdown, unload): also drop the runner and refuse further work. Waits up to
        ``wait_s`` for a running slice; past that (or with 0) the engine thread drops its
        state when the slice returns, and publishes nothing of it."""
        self._cancel.request(forget=forget)
        if self._work.acquire(timeout=wait_s) if wait_s > 0 else self._work.acquire(blocking=False):
            try:
                self._drop_everything(reason)
            finally:
                self._work.release()
        else:
            log.warning(
                "mlx-recovery: engine %s: a slice is still running; it drops its state "
                "when it returns (%s)", self.engine_id, reason,
            )

    def release_pending(self) -> int:
        """Any thread, once the engine is closed (or from its own thread): try again to give
        back the references whose release failed; returns how many holders still hold some.
        Never waits for a running slice (that slice retries them itself)."""
        if self._work.acquire(blocking=False):
            try:
                self._ledger.retry(lambda: self.port.prefix_cache)
            finally:
                self._work.release()
        return self._ledger.pending

    # -- status (any thread) -------------------------------------------------------

    def snapshot(self) -> EngineStatus:
        now = self._clock()
        with self._lock:
            policy = dict(self.judge.status())
            # The judge's copy of the fit: the cost model itself is the engine thread's.
            fit = dense_fit(policy)
            jobs = tuple(JobStatus.of(job, self.block_size, now, self._returns.due(job.job_id), self._work_s(job, fit))
                         for job in self.book)
            live_job = self._live.job
            return EngineStatus(
                engine_id=self.engine_id,
                model_id=self.model_id,
                block_size=self.block_size,
                slice_tokens=self.slice_tokens,
                closed=self.closed,
                jobs=jobs,
                live_job_id=live_job.job_id if live_job is not None else None,
                live_offset=self._live.offset,
                last_refusal=self.last_refusal,
                counters=self.counters.copy(),
                policy=policy,
                unreleased_holders=self._ledger.pending,
                host_refuses=self.host_refuses,
                held_bound_mib=self._max_held_bytes / 2**20,
                stop_grain=self._stop_grain,
            )

    # -- the slice loop (engine thread, under _work) -------------------------------

    def _idle_step(self, consecutive: int) -> bool | float | None:
        if self._cancel.stop_requested():
            self._drop_everything("cancelled")
        if self.closed:
            return None
        self._ledger.retry(lambda: self.port.prefix_cache)
        if self._ledger.failing:
            return self._releases_failing()
        now = self._clock()
        with self._lock:
            job = self._most_worth_it(now)
            if job is None and self._reopen_stood_down():
                job = self._most_worth_it(now)
            wait = self.book.seconds_until_unparked(now)
            recheck_load = job is None and self.judge.regime is Regime.BUSY and any(
                j.stood_down is not None or j.paused is not None for j in self.book)
        if job is None:
            self._retire_live()
            self._publish_held_that_now_pays()
            if self._ledger.pending:
                wait = _sooner(wait, RELEASE_RETRY_S)
            if recheck_load:
                wait = _sooner(wait, LOAD_RECHECK_S)
            return _later(wait)

        generation, arrivals = self._cancel.generation, self._arrivals()
        decision = self._gate.check(self.port, consecutive)
        if not decision.runnable:
            return self._refused(decision.reason or Refusal.HOST_ERROR)
        if not self._budget.try_claim(self.engine_id):
            return self._refused(Refusal.CLAIM_TAKEN)
        self._in_hand = job.job_id

        def should_stop() -> bool:
            return self._cancel.stop_requested() or self._arrivals() != arrivals

        started = self._clock()
        self._phases.begin(started)
        ran, context = 0, 0
        try:
            ran, context = self._run_slice(job, should_stop)
        finally:
            spent = max(0.0, self._clock() - started)
            self._sizer.learn(ran, spent, context)
            self._budget.charge(spent)
            self._budget.release_claim(self.engine_id)
            waits = self._arrival_waits(arrivals)
            with self._lock:
                self.counters.slice_seconds += spent
                self.counters.slice_seconds_max = max(self.counters.slice_seconds_max, spent)
                for behind in waits:
                    self.counters.waited(behind)
        if self._cancel.generation != generation:
            self._drop_everything("cancelled")
            return None
        now = self._clock()
        with self._lock:
            more = self.book.next_runnable(now) is not None
            wait = self.book.seconds_until_unparked(now)
        return True if more else _later(wait)

    def _releases_failing(self) -> float:
        """The host keeps refusing to take its references back: hold no live state and
        take no more references; try the releases again later, then resume."""
        self._retire_live()
        with self._lock:
            first = self.last_refusal != Refusal.RELEASES_FAILING.value
            self.last_refusal = Refusal.RELEASES_FAILING.value
            self.counters.refused(Refusal.RELEASES_FAILING.value)
            pending = self._ledger.pending
        if first:
            log.error(
                "mlx-recovery: engine %s: the host's release keeps failing (%d holder(s) still "
                "hold references); recovery takes no more until they are given back",
                self.engine_id, pending,
            )
        return RELEASE_RETRY_S

    def _refused(self, reason: Refusal) -> bool | float | None:
        with self._lock:
            self.last_refusal = reason.value
            self.counters.refused(reason.value)
        if reason is Refusal.NOT_ENOUGH_IDLE_STEPS:
            return True  # transient: the next idle steps will pass
        if reason not in KEEP_LIVE_THROUGH:
            self._retire_live()
        if reason in (Refusal.BUDGET_OFF, Refusal.MEMORY_PRESSURE):
            self._drop_held_blocks(reason)
        if reason is Refusal.HOST_ERROR:
            self._count_fault(FaultKind.HOST_GONE)
            self._drop_everything(FaultKind.HOST_GONE.value)
            return None
        if reason is Refusal.BUDGET_OFF:
            # Jobs left from before the budget went to 0: look again once a window, so a
            # budget raised in place resumes them on an idle host that steps only on request.
            with self._lock:
                pending = len(self.book) > 0
            return self._budget.window_s if pending else None
        if reason is Refusal.MODEL_NOT_OPTED_IN:
            return None
        if reason is Refusal.BUDGET_SPENT:
            wait = self._budget.seconds_until_available()
            return wait if math.isfinite(wait) and wait > 0 else RETRY_S
        return RETRY_S

    def _arrival_waits(self, arrivals_before: int) -> list[dict[str, float]]:
        """Of each request that came in during the idle step now ending (it then waited
        for the step's end), the seconds from its arrival, or the step's beginning, to
        now, per part of the step that ran meanwhile."""
        _, times = self._arrivals_since(arrivals_before)
        now = self._clock()
        return [self._phases.behind(at, now) for at in times]

    def _run_slice(self, job: RecoveryJob, should_stop: Callable[[], bool]) -> tuple[int, int]:
        """Run one slice of ``job``; returns the tokens of a slice that ran whole (0 else)
        and the context it started at."""
        if not self._have_runner():
            return 0, 0
        self._phases.mark(PROBE, self._clock())
        self._time_attention(job)
        self._phases.mark(VERDICT, self._clock())
        if self._stands_down_or_pauses(job):
            return 0, 0
        # A request that came in behind the parts that cannot stop waits for no more of
        # them: fetching the host's blocks for a slice that would stop at once is not begun.
        if should_stop():
            return 0, 0
        end_target = job.publish_end(self.block_size)
        if not self._live.is_for(job, end_target):
            self._phases.mark(START, self._clock())
            self._retire_live()
            if not self._start(job, end_target):
                return 0, 0

        start = self._live.start_offset
        end = self._sizer.end(start, end_target)
        grain = self._stop_grain = self._sizer.stop_grain(end, self._live.layers)
        began = self._clock()
        self._phases.mark(SLICE, began)
        try:
            outcome = self._live.advance(end, should_stop, grain)
        except Exception as exc:  # noqa: BLE001 - runner faults park the job
            self._runner_fault(job, exc)
            return 0, start
        seconds = self._clock() - began
        self._phases.mark(SETTLE, began + seconds)
        with self._lock:
            self.counters.slices += 1
            self.counters.tokens_run += int(outcome.tokens_run)
        if outcome.interrupted:
            with self._lock:
                self.counters.slices_interrupted += 1
                self.last_refusal = Refusal.SLICE_INTERRUPTED.value
                self._hold_finished_locked(job, list(outcome.blocks))
            self._retire_live()
            return 0, start
        self.judge.observe(start, int(outcome.tokens_run), seconds)
        if self._cancel.stop_requested():
            return 0, start  # cancelled while the slice ran: publish nothing
        if not self._settle_slice(job, outcome):
            return 0, start
        return int(outcome.tokens_run), start

    def _settle_slice(self, job: RecoveryJob, outcome: SliceOutcome) -> bool:
        """Publish or hold a whole slice's blocks and book the job's progress. False after
        a publication fault."""
        if outcome.blocks and not self._publish_or_hold(job, list(outcome.blocks)):
            return False
        with self._lock:
            job.progressed()
            # Held whole (for its conversation's return) is finished too: nothing more to run.
            finished = self._complete_if_done_locked(job) or job.stood_down is not None or job.held_whole(self.block_size)
        if finished:
            self._retire_live()
        return True

    def _start(self, job: RecoveryJob, end_target: int) -> bool:
        """Begin a live state at the whole-block prefix the host has now. False when there
        is nothing to run (done, or a fault)."""

        def settle(restorable: int) -> tuple[BlockState, ...] | None:
            with self._lock:
                self.counters.ground_lost_tokens += job.restore_to(restorable, self.block_size)
                if self._complete_if_done_locked(job):
                    return None
                return tuple(job.held)

        started = self._live.start(job, end_target, settle)
        if started.outcome is Start.FETCH_FAILED:
            log.warning("mlx-recovery: engine %s: fetch failed: %r", self.engine_id, started.error)
            self._drop_job(job, FaultKind.FETCH_ERROR)
        elif started.outcome is Start.RUNNER_FAILED:
            assert started.error is not None
            self._runner_fault(job, started.error)
        return started.outcome is Start.STARTED

    # -- the publish policy (engine thread, under _work) -------------------------------

    def _publish_or_hold(self, job: RecoveryJob, blocks: list[BlockState]) -> bool:
        """Publish the held blocks and ``blocks`` when the policy says the prefix pays,
        else keep them held (or stand the job down). False after a publication fault."""
        with self._lock:
            pending = job.pending_with(blocks, self.block_size)
        decision = self.judge.judge(job, job.committed + len(pending) * self.block_size)
        with self._lock:
            held_elsewhere = sum(j.held_bytes() for j in self.book if j is not job)
            too_much = held_elsewhere + sum(b.nbytes for b in pending) > self._max_held_bytes
        spill = decision.verdict is Verdict.HOLD and decision.may_spill and too_much
        whole = self.judge.before_work(job) if spill else None
        if spill and whole is not None and whole.verdict is not Verdict.PUBLISH:
            # A partial prefix under a sparse turn costs that turn on a host that keys its
            # draft's reading by the uncached part (oMLX: 256 published tokens, 4.4x), and
            # pays only by bringing a whole prefix that pays closer.
            spill = False
        if decision.verdict is Verdict.PUBLISH and self.judge.waits_for_arrival and not too_much:
            # The conversation's next request is judged on its real length instead.
            with self._lock:
                job.hold(pending, self.judge.evidence)
                self.counters.slices_held += 1
            return True
        if decision.verdict is Verdict.PUBLISH or spill:
            with self._lock:
                job.release_held()
            return self._publish(job, pending)
        with self._lock:
            if decision.verdict is Verdict.HOLD:
                if too_much:
                    why = "" if whole is None else f"; publishing them would not pay: {whole.reason}"
                    self._stand_down_locked(
                        job, f"holding {len(pending)} finished blocks would pass {env_name('max_held_mib')}{why}"
                    )
                else:
                    job.hold(pending, self.judge.evidence)
                    self.counters.slices_held += 1
            else:
                self._stand_down_locked(job, decision.reason)
        return True

    def _hold_finished_locked(self, job: RecoveryJob, blocks: list[BlockState]) -> None:
        """Under ``_lock``: an interrupted slice's finished passes are held, so the job's next
        slice goes on from them instead of redoing them (the next whole slice's verdict
        covers them); dropped instead if holding them would pass the held-memory bound."""
        if not blocks:
            return
        pending = job.pending_with(blocks, self.block_size)
        held_elsewhere = sum(j.held_bytes() for j in self.book if j is not job)
        if held_elsewhere + sum(b.nbytes for b in pending) <= self._max_held_bytes:
            job.hold(pending)

    def _complete_if_done_locked(self, job: RecoveryJob) -> bool:
        """Under ``_lock``: a job whose whole prefix is committed leaves the book."""
        if not job.done(self.block_size):
            return False
        self.book.complete(job.job_id)
        self.counters.jobs_completed += 1
        return True

    def _publish_held_that_now_pays(self) -> None:
        """A whole prefix held "not yet clear" is not worked on again, so nothing else would
        judge it before its conversation returns: judge it again once the evidence has
        grown (another job's slices, the host's own turns), and publish it if it pays.
        Where publications wait for the conversation's return, that is where it is judged."""
        if self.judge.waits_for_arrival:
            return
        with self._lock:
            waiting = [j for j in self.book if j.held_whole(self.block_size) and j.held_evidence < self.judge.evidence]
        for job in waiting:
            end = job.publish_end(self.block_size)
            decision = self.judge.judge(job, end)
            with self._lock:
                job.held_evidence = self.judge.evidence
                pending = job.pending_with([], self.block_size)
                if decision.verdict is not Verdict.PUBLISH:
                    continue
                job.release_held()
            if self._publish(job, pending):
                with self._lock:
                    self._complete_if_done_locked(job)

    def _drop_held_blocks(self, reason: Refusal) -> None:
        """Recovery is off or memory is short: give back what the policy held."""
        with self._lock:
            dropped = sum(job.drop_held() for job in self.book)
            self.counters.held_blocks_dropped += dropped
        if dropped:
            log.info("mlx-recovery: engine %s: %d held block(s) dropped (%s)", self.engine_id, dropped, reason.value)

    def _most_worth_it(self, now: float) -> RecoveryJob | None:
        """Under ``_lock``: of the jobs that can be finished before their conversation is
        expected back, the one due first (:mod:`.returns`). Else the job in hand (the one
        the last slice was for), else the most recently served runnable job, unless
        another is expected to save clearly more per token of work (the policy's
        estimate). Timings of like conversations differ by noise, so the estimate alone
        would flit between them; and a prefix is worth little until it is whole (the
        policy holds a partial one back), so idle time spread over several conversations
        finishes none, while worked one at a time each conversation finished is restored
        from then on."""
        candidates = self.book.runnable(now)
        if not candidates:
            return None
        if DUE_FIRST:
            fit = self.judge.costs.coefficients()
            due = due_first(candidates, now=now, due=lambda job: self._returns.due(job.job_id),
                            work_s=lambda job: self._work_s(job, fit))
            if due is not None:
                return due
        in_hand = self._in_hand if FINISH_IN_HAND else None
        best = next((job for job in candidates if job.job_id == in_hand), candidates[0])
        best_saving = self.judge.expected_saving(best, now)
        for job in candidates:
            if job is best:
                continue
            saving = self.judge.expected_saving(job, now)
            if saving > CLEARLY_MORE * best_saving:
                best, best_saving = job, saving
        return best

    def _work_s(self, job: RecoveryJob, fit: tuple[float, float] | None) -> float | None:
        """Under ``_lock``: wall seconds the rest of ``job`` takes at the budget's share, at
        the dense cost's coefficients ``fit`` (None while no cost is fitted)."""
        if fit is None:
            return None
        frontier = job.frontier(self.block_size)
        seconds = pass_seconds(fit, max(0, job.publish_end(self.block_size) - frontier), frontier)
        share = self._budget.pct / 100.0
        return None if share <= 0 else seconds / share

    def _reopen_stood_down(self) -> bool:
        """Under ``_lock``: jobs stood down on evidence the cost model has since outgrown
        (another job's slices, the host's own dense appends, the machine's load regime
        changing) are judged again."""
        self.judge.look_at_load()
        evidence = self.judge.evidence
        return any([job.reconsider(evidence) for job in self.book])

    def _stands_down_or_pauses(self, job: RecoveryJob) -> bool:
        """Before working on ``job``: stand it down when even its whole prefix would not pay,
        and pause it (keeping what it holds) when the verdict on its whole prefix is not
        clear on evidence that already reaches it: its slices would only be held, and the
        idle time is better left to a job that pays (or to nobody). More evidence, or the
        conversation's next turn, resumes it. After a new turn a stand-down waits for one
        slice: it is then taken on a measurement of the machine as it is now, at the job's
        frontier, so a wrong one costs at most a turn. A pause does not wait: it keeps what
        is held, any new evidence resumes it, and with several conversations the slices a
        paused job would run after each of its turns were only held and made other
        conversations' turns slower (bench server, attention-bound target)."""
        decision = self.judge.before_work(job)
        if decision is None:
            return False
        if job.fresh_turn and decision.verdict is Verdict.STAND_DOWN:
            return False
        with self._lock:
            if decision.verdict is Verdict.STAND_DOWN:
                self._stand_down_locked(job, decision.reason)
            elif decision.verdict is Verdict.HOLD and decision.settled:
                if job.pause(decision.reason, self.judge.evidence):
                    self.counters.jobs_paused += 1
                    log.info("mlx-recovery: engine %s: job %d paused: %s", self.engine_id, job.job_id,
                             decision.reason)
            else:
                return False
        self._retire_live()
        return True

    def _time_attention(self, job: RecoveryJob) -> None:
        """Where the verdict on ``job``'s whole prefix lies beyond what the slices measured,
        time the model's attention that deep first (0.03-0.6 s at 2-12k context, charged to
        the idle step like a slice): the verdict's lower bound then grows with the context."""
        probe = self._attention_probe
        context = None if probe is None else self.judge.attention_wanted(job)
        if probe is None or context is None:
            return
        try:
            seconds = probe(context)
        except Exception as exc:  # noqa: BLE001 - the probe is an aid; the slices go on without it
            log.warning("mlx-recovery: engine %s: attention probe failed, not used again: %s", self.engine_id, exc)
            seconds = None
        if seconds is None:
            self._attention_probe = None
            return
        with self._lock:
            self.counters.attention_probes += 1
        self.judge.observe_attention(context, seconds)

    def _stand_down_locked(self, job: RecoveryJob, reason: str) -> None:
        if job.stand_down(reason, self.judge.evidence):
            self.counters.jobs_stood_down += 1
            log.info("mlx-recovery: engine %s: job %d stands down: %s", self.engine_id, job.job_id, reason)

    def _publish(self, job: RecoveryJob, blocks: list[BlockState]) -> bool:
        """Store ``blocks`` (from :meth:`RecoveryJob.pending_with`: none the host restores
        already) and commit what the read-back gives."""
        if not blocks:
            return True
        if blocks[0].index * self.block_size != job.committed:
            log.error(
                "mlx-recovery: engine %s: slice blocks start at %d, job committed %d",
                self.engine_id, blocks[0].index * self.block_size, job.committed,
            )
            self._drop_job(job, FaultKind.LINEAGE_ERROR)
            return False
        if self._cancel.stop_requested():
            return False  # the engine is being cancelled: write nothing more to it
        try:
            cache = self.port.prefix_cache

            def release(holder: str) -> None:
                self._ledger.release(cache, holder)

            result = publish(
                cache,
                job.tokens,
                blocks,
                self.block_size,
                holder_id=self._ledger.holder("store"),
                probe_id=self._ledger.holder("probe"),
                release=release,
            )
        except PublicationError as exc:
            log.warning("mlx-recovery: engine %s: publication failed: %s", self.engine_id, exc)
            self._drop_job(job, exc.kind)
            self._note_publication_failure(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. the port itself is gone
            log.warning("mlx-recovery: engine %s: publication failed: %r", self.engine_id, exc)
            self._drop_job(job, FaultKind.HOST_GONE)
            return False
        with self._lock:
            gained = job.commit(result.boundary)
            self.counters.tokens_recovered += gained
            self.counters.blocks_published += result.blocks
        return True

    # -- faults and dropping (engine thread) -----------------------------------------

    def _have_runner(self) -> bool:
        try:
            self._live.runner()
        except Exception as exc:  # noqa: BLE001 - the model is gone or unusable
            log.warning("mlx-recovery: engine %s: no runner: %r", self.engine_id, exc)
            self._count_fault(FaultKind.HOST_GONE)
            self._drop_everything(FaultKind.HOST_GONE.value)
            return False
        return True

    def _runner_fault(self, job: RecoveryJob, exc: Exception) -> None:
        kind = runner_fault_kind(exc)
        log.warning("mlx-recovery: engine %s: slice failed (%s): %r", self.engine_id, kind.value, exc)
        self._count_fault(kind)
        self._retire_live()
        with self._lock:
            kept = self.book.park(
                job, self._clock(), base_s=PARK_BASE_S, max_s=PARK_MAX_S, max_attempts=PARK_MAX_ATTEMPTS
            )
            if not kept:
                self.counters.jobs_dropped += 1
        if kind is FaultKind.OOM:
            _clear_mlx_cache()

    def _note_publication_failure(self, exc: PublicationError) -> None:
        """Stop taking jobs on an engine whose host keeps restoring nothing we publish."""
        with self._lock:
            ever_committed = self.counters.tokens_recovered > 0
        reason = self._refusals.note_failure(exc, ever_committed=ever_committed)
        if reason is None:
            return
        with self._lock:
            self.host_refuses = reason
        log.warning("mlx-recovery: engine %s: %s", self.engine_id, reason)
        self._drop_everything(Refusal.HOST_RESTORES_NOTHING.value)
        self._live.drop_runner()  # no slice will run here again: give its memory back

    def _drop_job(self, job: RecoveryJob, kind: FaultKind) -> None:
        self._count_fault(kind)
        self._retire_live()
        with self._lock:
            if self.book.remove(job.job_id) is not None:
                self.counters.jobs_dropped += 1

    def _retire_live(self) -> None:
        if self._live.retire():
            with self._lock:
                self.counters.live_retired += 1

    def _drop_everything(self, reason: str) -> None:
        self._retire_live()
        self._ledger.retry(lambda: self.port.prefix_cache)
        with self._lock:
            dropped = self.book.clear()
            self.judge.keep_only(())
            self._returns.keep_only(())
            self.counters.jobs_cancelled += len(dropped)
            if self.closed:
                self._live.drop_runner()
            self._cancel.settled()
        if dropped:
            log.info("mlx-recovery: engine %s: %d job(s) cancelled (%s)", self.engine_id, len(dropped), reason)

    def _count_fault(self, kind: FaultKind) -> None:
        with self._lock:
            self.counters.fault(kind.value)


def _sooner(wait: float | None, seconds: float) -> float:
    """``wait``, or ``seconds`` where that comes first (or nothing else is waited for)."""
    return seconds if wait is None else min(wait, seconds)


def _later(wait: float | None) -> float | None:
    """An idle-hook answer for "nothing now, maybe in ``wait`` seconds"."""
    if wait is None:
        return None
    return max(wait, 1e-3)


def _clear_mlx_cache() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # noqa: BLE001 - best effort after an out-of-memory
        pass
