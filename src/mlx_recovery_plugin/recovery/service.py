"""One engine's recovery: its jobs, its live dense state, and the slice loop.

Each idle step the engine offers runs at most one slice: pick the job most likely to be
asked for again, ask the runnable gate, take the execution claim, densely prefill up to
``slice_tokens`` more tokens, charge the budget, publish the whole blocks the slice
completed and advance the committed boundary only after the host's fetch path gives
them back. Whenever the gate says no for more than a few idle steps, the live state is
retired and the job later resumes from its committed block, fetched back from the host.

Faults never leave this module: a runner error or out-of-memory parks the job with
back-off; a store error, a probe that restores less, a failing fetch or a vanished host
drops it. Every fetch and probe reference is given back in ``finally``.

Threads. The engine thread runs :meth:`EngineRecovery.idle_step`,
:meth:`EngineRecovery.served` and :meth:`EngineRecovery.foreground`; it alone touches
the runner and the live state, and it holds ``_work`` while it does. Cancellation may
come from any thread (shutdown, unload): it sets ``_stop``, which the running slice's
``should_stop`` sees, and then either cleans up itself (``_work`` free) or leaves that to
the engine thread when its slice returns. The job book and counters are guarded by
``_lock``, which is only ever held briefly; :meth:`snapshot` reads under it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..events import SparseRouteServed
from ..ports import HOLDER_PREFIX, EnginePort, FetchedPrefix, ModelHandle
from ..settings import RecoverySettings
from ..state import BlockState, floor_block
from . import runnable as reasons
from .budget import Budget
from .costs import Verdict
from .jobs import JobBook, RecoveryJob, Relation
from .judge import PublishJudge, note_route
from .publication import ProbeMismatch, PublicationError, publish
from .runnable import RunnableGate
from .status import EngineCounters, EngineStatus, JobStatus

log = logging.getLogger(__name__)

# Fault kinds (status counters). Publication faults carry their own kind.
RUNNER_ERROR = "runner_error"
OOM = "oom"
FETCH_ERROR = "fetch_error"
HOST_GONE = "host_gone"
RELEASE_ERROR = "release_error"
LINEAGE_ERROR = "lineage_error"
INTERNAL_ERROR = "internal_error"

INTERRUPTED = "slice_interrupted"  # a refusal-like reason for the status
# A request whose cache keys hold more than its tokens (an image's hash): no job for it.
KEYED_BEYOND_TOKENS = "keyed_beyond_tokens"
# The host restored none of what recovery published, several times in a row, and never
# anything on this engine: it refuses the plugin's blocks (a quantized KV layout, a
# recurrent state it does not store). Each further job would cost a slice for nothing.
HOST_RESTORES_NOTHING = "host_restores_nothing"
HOST_RESTORES_NOTHING_AFTER = 3

# Refusals that are not foreground work: the live state is kept through them, so a
# machine whose allowance pays for less than a block per window still finishes blocks.
_KEEP_LIVE_THROUGH = frozenset({reasons.NOT_ENOUGH_IDLE_STEPS, reasons.BUDGET_SPENT, reasons.CLAIM_TAKEN})

# Ask again after this long when another engine or a request holds the process.
RETRY_S = 0.1
# Back-off after a runner fault, doubled per repeat, and the repeats before giving up.
PARK_BASE_S = 1.0
PARK_MAX_S = 60.0
PARK_MAX_ATTEMPTS = 5
# How soon a holder whose release failed is tried again on an otherwise idle engine.
RELEASE_RETRY_S = 1.0
# How long a cancellation from another thread waits for a running slice to stop.
CANCEL_WAIT_S = 2.0


_OOM_MARKERS = ("out of memory", "unable to allocate", "bad_alloc", "outofmemory", "oom")


class SliceOutcomeLike(Protocol):
    @property
    def blocks(self) -> list[BlockState]: ...

    @property
    def tokens_run(self) -> int: ...

    @property
    def interrupted(self) -> bool: ...


class SliceRunnerLike(Protocol):
    """What the service needs from :class:`mlx_recovery_plugin.runner.SliceRunner`."""

    def begin(self, tokens: Sequence[int], prefix: FetchedPrefix | None) -> Any: ...

    def advance(
        self, live: Any, end: int, should_stop: Callable[[], bool] | None = None
    ) -> SliceOutcomeLike: ...

    def discard(self, live: Any) -> None: ...


RunnerFactory = Callable[[ModelHandle, int, bool], SliceRunnerLike]


def default_runner_factory(model: ModelHandle, block_size: int, interruptible: bool) -> SliceRunnerLike:
    from ..runner import SliceRunner

    return SliceRunner(model, block_size, interruptible=interruptible)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _OOM_MARKERS)


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
        clock: Callable[[], float],
        runner_factory: RunnerFactory = default_runner_factory,
    ) -> None:
        self.port = port
        self.engine_id = port.engine_id
        self.model_id = port.model_id
        self.block_size = int(port.block_size)
        self.slice_tokens = settings.slice_tokens_for(self.model_id, int(port.prefill_step))
        self._settings = settings
        self._budget = budget
        self._gate = gate
        self._arrivals = arrivals
        self._clock = clock
        self._runner_factory = runner_factory

        self._lock = threading.RLock()  # book, counters, last_refusal, live bookkeeping
        self._work = threading.RLock()  # held by the engine thread for a whole idle step
        self._stop = threading.Event()
        self._cancel_gen = 0
        self.closed = False
        # Recovered tokens per charged second, learned from whole slices (engine thread).
        self._tokens_per_s: float | None = None
        # The publish policy with what it learned (engine thread; status under _lock).
        self.judge = PublishJudge(settings.publish_policy, self.block_size)
        self.book = JobBook(self.block_size, settings.max_jobs_per_engine)
        self.counters = EngineCounters()
        self.last_refusal: str | None = None
        # Set once by the engine thread (see HOST_RESTORES_NOTHING); read by any thread.
        self.host_refuses: str | None = None

        # Engine thread only (under _work).
        self._runner: SliceRunnerLike | None = None
        self._live: Any = None
        self._live_job: RecoveryJob | None = None
        self._live_end = 0
        self._live_offset: int | None = None  # mirrored under _lock for the status
        # Holders whose release raised: their host references are retried on later idle
        # steps and when the engine's jobs are dropped (shutdown, unload), never forgotten.
        self._unreleased: list[str] = []
        self._holder_ids = itertools.count(1)
        self._empty_readbacks = 0  # in a row, on an engine that never committed anything

    # -- hooks (engine thread) -----------------------------------------------------

    def served(self, event: SparseRouteServed) -> None:
        """A sparse route served ``event``'s range: queue, extend or replace a job."""
        if self.closed:
            return
        if event.keyed_beyond_tokens or self.host_refuses is not None:
            with self._lock:
                self.counters.refused(KEYED_BEYOND_TOKENS if event.keyed_beyond_tokens else HOST_RESTORES_NOTHING)
            return
        with self._lock:
            offer = self.book.offer(event.tokens, event.served_start, event.served_end)
            if offer.job is not None:
                note_route(offer.job, event)
            if offer.relation in (Relation.UNRELATED, Relation.FORKS):
                self.counters.jobs_queued += 1
            elif offer.relation is Relation.EXTENDS:
                self.counters.jobs_extended += 1
            self.counters.jobs_dropped += len(offer.dropped)
            live_job = self._live_job
        if live_job is not None and (live_job is offer.job or live_job in offer.dropped):
            self.foreground()

    def foreground(self) -> None:
        """Foreground work reached this engine: give the live state's memory back now."""
        if self._live is None:
            return
        if self._work.acquire(blocking=False):
            try:
                self._retire_live()
            finally:
                self._work.release()

    def idle_step(self, consecutive: int) -> bool | float | None:
        """Run at most one slice. True: offer another idle step now; a float: ask again
        after that many seconds; None: nothing to do. Never raises."""
        if self.closed or (len(self.book) == 0 and self._live is None and not self._unreleased):
            return None
        if not self._work.acquire(blocking=False):
            return RETRY_S  # a cancellation from another thread is cleaning up
        try:
            return self._idle_step(consecutive)
        except Exception as exc:
            log.error("mlx-recovery: engine %s idle step failed: %r", self.engine_id, exc, exc_info=exc)
            self._count_fault(INTERNAL_ERROR)
            self._retire_live()
            return None
        finally:
            self._work.release()

    # -- cancellation (any thread) -------------------------------------------------

    def cancel(self, reason: str, *, forget: bool = False) -> None:
        """Drop every job and the live state at once. ``forget``: the engine is going
        away (shutdown, unload): also drop the runner and refuse further work."""
        with self._lock:
            self._cancel_gen += 1
            if forget:
                self.closed = True
        self._stop.set()
        if self._work.acquire(timeout=CANCEL_WAIT_S):
            try:
                self._drop_everything(reason)
            finally:
                self._work.release()
        else:
            log.warning(
                "mlx-recovery: engine %s: a slice is still running; it drops its state "
                "when it returns (%s)", self.engine_id, reason,
            )

    # -- status (any thread) -------------------------------------------------------

    def snapshot(self) -> EngineStatus:
        now = self._clock()
        with self._lock:
            jobs = tuple(
                JobStatus(
                    job_id=job.job_id,
                    tokens=len(job.tokens),
                    committed=job.committed,
                    target_end=job.target_end,
                    publish_end=job.publish_end(self.block_size),
                    debt=job.debt,
                    attempts=job.attempts,
                    parked_for_s=(job.parked_until - now) if job.parked(now) else None,  # type: ignore[operator]
                    tokens_recovered=job.tokens_recovered,
                    held_tokens=len(job.held) * self.block_size,
                    stood_down=job.stood_down,
                )
                for job in self.book
            )
            live_job = self._live_job
            policy = self.judge.status()
            return EngineStatus(
                engine_id=self.engine_id,
                model_id=self.model_id,
                block_size=self.block_size,
                slice_tokens=self.slice_tokens,
                closed=self.closed,
                jobs=jobs,
                live_job_id=live_job.job_id if live_job is not None else None,
                live_offset=self._live_offset,
                last_refusal=self.last_refusal,
                counters=self.counters.copy(),
                policy=policy,
                # Owned by the engine thread; the length read here is a status figure only.
                unreleased_holders=len(self._unreleased),
                host_refuses=self.host_refuses,
            )

    # -- the slice loop (engine thread, under _work) -------------------------------

    def _idle_step(self, consecutive: int) -> bool | float | None:
        self._finish_cancel_if_pending()
        if self.closed:
            return None
        self._retry_releases()
        now = self._clock()
        with self._lock:
            job = self.book.next_runnable(now)
            wait = self.book.seconds_until_unparked(now)
        if job is None:
            self._retire_live()
            if self._unreleased:
                wait = RELEASE_RETRY_S if wait is None else min(wait, RELEASE_RETRY_S)
            return _later(wait)

        cancel_gen, arrivals = self._cancel_gen, self._arrivals()
        decision = self._gate.check(self.port, consecutive)
        if not decision.runnable:
            return self._refused(decision.reason or "unknown")
        if not self._budget.try_claim(self.engine_id):
            return self._refused(reasons.CLAIM_TAKEN)

        def should_stop() -> bool:
            return self._stop.is_set() or self._arrivals() != arrivals

        started = self._clock()
        ran = 0
        try:
            ran = self._run_slice(job, should_stop)
        finally:
            spent = max(0.0, self._clock() - started)
            self._learn_rate(ran, spent)
            self._budget.charge(spent)
            self._budget.release_claim(self.engine_id)
            with self._lock:
                self.counters.slice_seconds += spent
                self.counters.slice_seconds_max = max(self.counters.slice_seconds_max, spent)
        if self._cancel_gen != cancel_gen:
            self._finish_cancel_if_pending(force=True)
            return None
        now = self._clock()
        with self._lock:
            more = self.book.next_runnable(now) is not None
            wait = self.book.seconds_until_unparked(now)
        return True if more else _later(wait)

    def _refused(self, reason: str) -> bool | float | None:
        with self._lock:
            self.last_refusal = reason
            self.counters.refused(reason)
        if reason == reasons.NOT_ENOUGH_IDLE_STEPS:
            return True  # transient: the next idle steps will pass
        if reason not in _KEEP_LIVE_THROUGH:
            self._retire_live()
        if reason == reasons.HOST_ERROR:
            self._count_fault(HOST_GONE)
            self._drop_everything(HOST_GONE)
            return None
        if reason == reasons.BUDGET_OFF:
            # Jobs left from before the budget went to 0: look again once a window, so a
            # budget raised in place resumes them on an idle host that steps only on request.
            with self._lock:
                pending = len(self.book) > 0
            return self._budget.window_s if pending else None
        if reason == reasons.MODEL_NOT_OPTED_IN:
            return None
        if reason == reasons.BUDGET_SPENT:
            wait = self._budget.seconds_until_available()
            return wait if math.isfinite(wait) and wait > 0 else RETRY_S
        return RETRY_S

    def _run_slice(self, job: RecoveryJob, should_stop: Callable[[], bool]) -> int:
        """Run one slice of ``job``; returns the tokens of a slice that ran whole (0 else)."""
        runner = self._ensure_runner()
        if runner is None:
            return 0
        if self._stands_down(job):
            return 0
        end_target = job.publish_end(self.block_size)
        if self._live is None or self._live_job is not job or self._live_end != end_target:
            self._retire_live()
            if not self._start(job, runner, end_target):
                return 0

        start = self._live.offset
        end = self._slice_end(start, end_target)
        began = self._clock()
        try:
            outcome = runner.advance(self._live, end, should_stop)
        except Exception as exc:  # noqa: BLE001 - runner faults park the job
            self._runner_fault(job, exc)
            return 0
        seconds = self._clock() - began
        with self._lock:
            self.counters.slices += 1
            self.counters.tokens_run += int(outcome.tokens_run)
            self._live_offset = int(self._live.offset)
        if outcome.interrupted:
            with self._lock:
                self.counters.slices_interrupted += 1
                self.last_refusal = INTERRUPTED
            self._retire_live()
            return 0
        self.judge.observe(start, int(outcome.tokens_run), seconds)
        if self._stop.is_set():
            return 0  # cancelled while the slice ran: publish nothing
        if outcome.blocks and not self._publish_or_hold(job, list(outcome.blocks)):
            return 0
        with self._lock:
            job.attempts, job.parked_until = 0, None
            if job.done(self.block_size):
                self.book.remove(job.job_id)
                self.counters.jobs_completed += 1
                finished = True
            else:
                finished = job.stood_down is not None
        if finished:
            self._retire_live()
        return int(outcome.tokens_run)

    def _slice_tokens_now(self) -> int:
        """The configured slice, fitted to what the window's remaining allowance pays for
        at the measured rate, but never below one block: a slice that finishes no block
        publishes nothing, and whatever a slice overspends the next windows pay back.
        The first slice, whose rate is not known yet, is one block at most: on a slow
        machine a whole configured slice could overshoot many windows at once."""
        if self._tokens_per_s is None:
            return min(self.slice_tokens, self.block_size)
        if math.isinf(self._tokens_per_s):
            return self.slice_tokens
        affordable = floor_block(int(self._tokens_per_s * self._budget.remaining_s()), self.block_size)
        return min(self.slice_tokens, max(self.block_size, affordable))

    def _slice_end(self, start: int, end_target: int) -> int:
        """Where the next slice stops: its size from :meth:`_slice_tokens_now`, cut back to
        a block boundary when it would otherwise leave a block half done."""
        end = min(start + self._slice_tokens_now(), end_target)
        whole = floor_block(end, self.block_size)
        return whole if end < end_target and whole > start else end

    def _learn_rate(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        # A slice the clock did not see (a clock coarser than the slice) cost nothing.
        rate = tokens / seconds if seconds > 0 else math.inf
        old = self._tokens_per_s
        self._tokens_per_s = rate if old is None else 0.5 * old + 0.5 * rate

    def _start(self, job: RecoveryJob, runner: SliceRunnerLike, end_target: int) -> bool:
        """Begin a live state at the whole-block prefix the host has now (fetch, begin,
        release). False when there is nothing to run (done, or a fault)."""
        lineage = job.tokens[:end_target]
        holder = self._holder("start")
        cache = self.port.prefix_cache
        try:
            try:
                prefix = cache.fetch(holder, lineage)
            except Exception as exc:  # noqa: BLE001 - the host's fetch failed
                log.warning("mlx-recovery: engine %s: fetch failed: %r", self.engine_id, exc)
                self._drop_job(job, FETCH_ERROR)
                return False
            restorable = floor_block(min(int(prefix.tokens), end_target), self.block_size)
            with self._lock:
                if restorable < job.committed:
                    self.counters.ground_lost_tokens += job.committed - restorable
                    job.held = []  # held blocks sit on a prefix the host lost
                job.committed = restorable
                job.drop_held_below(restorable, self.block_size)
                if job.done(self.block_size):
                    self.book.remove(job.job_id)
                    self.counters.jobs_completed += 1
                    return False
                held = tuple(job.held)
            blocks = tuple(prefix.blocks[: restorable // self.block_size]) + held
            prefix = FetchedPrefix(len(blocks) * self.block_size, blocks)
            try:
                live = runner.begin(lineage, prefix if prefix.tokens else None)
            except Exception as exc:  # noqa: BLE001 - runner faults park the job
                self._runner_fault(job, exc)
                return False
        finally:
            self._release(cache, holder)
        self._live, self._live_job, self._live_end = live, job, end_target
        with self._lock:
            self._live_offset = int(live.offset)
        return True

    # -- the publish policy (engine thread, under _work) -------------------------------

    def _publish_or_hold(self, job: RecoveryJob, blocks: list[BlockState]) -> bool:
        """Publish the held blocks and ``blocks`` when the policy says the prefix pays,
        else keep them held (or stand the job down). False after a publication fault."""
        with self._lock:
            # Blocks the host restores by itself by now (it may have stored them) drop out.
            pending = [b for b in (*job.held, *blocks) if b.index * self.block_size >= job.committed]
        decision = self.judge.judge(job, job.committed + len(pending) * self.block_size)
        if decision.verdict is Verdict.PUBLISH:
            with self._lock:
                job.held = []
            return self._publish(job, pending)
        with self._lock:
            if decision.verdict is Verdict.HOLD:
                job.held = pending
                self.counters.slices_held += 1
            else:
                self._stand_down_locked(job, decision.reason)
        return True

    def _stands_down(self, job: RecoveryJob) -> bool:
        """Before working on ``job``: stand it down when even its whole prefix would not pay."""
        reason = self.judge.stand_down_reason(job)
        if reason is None:
            return False
        with self._lock:
            self._stand_down_locked(job, reason)
        self._retire_live()
        return True

    def _stand_down_locked(self, job: RecoveryJob, reason: str) -> None:
        if job.stood_down is None:
            self.counters.jobs_stood_down += 1
            log.info("mlx-recovery: engine %s: job %d stands down: %s", self.engine_id, job.job_id, reason)
        job.stood_down = reason
        job.held = []

    def _publish(self, job: RecoveryJob, blocks: list[BlockState]) -> bool:
        # Blocks the host already restores (it may have stored them meanwhile) need no store.
        blocks = [b for b in blocks if b.index * self.block_size >= job.committed]
        if not blocks:
            return True
        if blocks[0].index * self.block_size != job.committed:
            log.error(
                "mlx-recovery: engine %s: slice blocks start at %d, job committed %d",
                self.engine_id, blocks[0].index * self.block_size, job.committed,
            )
            self._drop_job(job, LINEAGE_ERROR)
            return False
        try:
            result = publish(
                self.port.prefix_cache,
                job.tokens,
                blocks,
                self.block_size,
                holder_id=self._holder("store"),
                probe_id=self._holder("probe"),
                release=lambda holder: self._release(self.port.prefix_cache, holder),
            )
        except PublicationError as exc:
            log.warning("mlx-recovery: engine %s: publication failed: %s", self.engine_id, exc)
            self._drop_job(job, exc.kind)
            self._note_empty_readback(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. the port itself is gone
            log.warning("mlx-recovery: engine %s: publication failed: %r", self.engine_id, exc)
            self._drop_job(job, HOST_GONE)
            return False
        with self._lock:
            gained = result.boundary - job.committed
            job.committed = result.boundary
            job.tokens_recovered += gained
            self.counters.tokens_recovered += gained
            self.counters.blocks_published += result.blocks
        return True

    # -- helpers (engine thread) ---------------------------------------------------

    def _ensure_runner(self) -> SliceRunnerLike | None:
        if self._runner is None:
            try:
                self._runner = self._runner_factory(
                    self.port.model, self.block_size, self._settings.interruptible
                )
            except Exception as exc:  # noqa: BLE001 - the model is gone or unusable
                log.warning("mlx-recovery: engine %s: no runner: %r", self.engine_id, exc)
                self._count_fault(HOST_GONE)
                self._drop_everything(HOST_GONE)
                return None
        return self._runner

    def _runner_fault(self, job: RecoveryJob, exc: Exception) -> None:
        kind = OOM if is_oom(exc) else RUNNER_ERROR
        log.warning("mlx-recovery: engine %s: slice failed (%s): %r", self.engine_id, kind, exc)
        self._count_fault(kind)
        self._retire_live()
        with self._lock:
            kept = self.book.park(
                job, self._clock(), base_s=PARK_BASE_S, max_s=PARK_MAX_S, max_attempts=PARK_MAX_ATTEMPTS
            )
            if not kept:
                self.counters.jobs_dropped += 1
        if kind == OOM:
            _clear_mlx_cache()

    def _note_empty_readback(self, exc: PublicationError) -> None:
        """Stop taking jobs on an engine whose host keeps restoring nothing we publish."""
        with self._lock:
            never_committed = self.counters.tokens_recovered == 0
        if not (isinstance(exc, ProbeMismatch) and exc.restored == 0 and never_committed):
            self._empty_readbacks = 0
            return
        self._empty_readbacks += 1
        if self._empty_readbacks < HOST_RESTORES_NOTHING_AFTER:
            return
        reason = (
            f"the host restored none of what recovery published, {self._empty_readbacks} times in a "
            "row (a cache layout it keys differently, e.g. a quantized KV cache, or a state it does "
            "not store): recovery stands down on this engine"
        )
        with self._lock:
            self.host_refuses = reason
        log.warning("mlx-recovery: engine %s: %s", self.engine_id, reason)
        self._drop_everything(HOST_RESTORES_NOTHING)
        self._runner = None  # no slice will run here again: give its memory back

    def _drop_job(self, job: RecoveryJob, kind: str) -> None:
        self._count_fault(kind)
        self._retire_live()
        with self._lock:
            if self.book.remove(job.job_id) is not None:
                self.counters.jobs_dropped += 1

    def _retire_live(self) -> None:
        live, runner = self._live, self._runner
        self._live, self._live_job, self._live_end = None, None, 0
        with self._lock:
            self._live_offset = None
        if live is None:
            return
        with self._lock:
            self.counters.live_retired += 1
        if runner is None:
            return
        try:
            runner.discard(live)
        except Exception as exc:  # noqa: BLE001 - the state is dropped either way
            log.warning("mlx-recovery: engine %s: discard failed: %r", self.engine_id, exc)
            self._count_fault(INTERNAL_ERROR)

    def _drop_everything(self, reason: str) -> None:
        self._retire_live()
        self._retry_releases()
        with self._lock:
            dropped = self.book.clear()
            self.counters.jobs_cancelled += len(dropped)
            if self.closed:
                self._runner = None
                self._stop.set()
            else:
                self._stop.clear()
        if dropped:
            log.info("mlx-recovery: engine %s: %d job(s) cancelled (%s)", self.engine_id, len(dropped), reason)

    def _finish_cancel_if_pending(self, force: bool = False) -> None:
        if force or self._stop.is_set():
            self._drop_everything("cancelled")

    def _release(self, cache: Any, holder: str) -> None:
        """Give ``holder``'s references back; a failure is counted and the holder kept
        for :meth:`_retry_releases`. Never raises."""
        try:
            cache.release(holder)
        except Exception as exc:  # noqa: BLE001 - counted, and retried later
            log.error("mlx-recovery: engine %s: release(%s) failed: %r", self.engine_id, holder, exc)
            self._count_fault(RELEASE_ERROR)
            if holder not in self._unreleased:
                self._unreleased.append(holder)

    def _retry_releases(self) -> None:
        """Release again every holder whose release failed; keep those that still fail."""
        if not self._unreleased:
            return
        try:
            cache = self.port.prefix_cache
        except Exception as exc:  # noqa: BLE001 - the host is going away
            log.warning("mlx-recovery: engine %s: no cache to release into: %r", self.engine_id, exc)
            return
        still: list[str] = []
        for holder in self._unreleased:
            try:
                cache.release(holder)
            except Exception as exc:  # noqa: BLE001 - try again later
                log.warning("mlx-recovery: engine %s: release(%s) failed again: %r", self.engine_id, holder, exc)
                still.append(holder)
        self._unreleased = still

    def _holder(self, kind: str) -> str:
        return f"{HOLDER_PREFIX}:{self.engine_id}:{kind}:{next(self._holder_ids)}"

    def _count_fault(self, kind: str) -> None:
        with self._lock:
            self.counters.fault(kind)


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
