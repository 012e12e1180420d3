"""One engine's publish policy: what it has learned, what it remembers of each
conversation, and its verdicts.

The arithmetic is :mod:`.costs`; this is the state around it for one engine: the dense
cost model fitted to that engine's slices, the policy setting, what the host said of each
conversation's sparse route (threshold, keep share, measured sparse prefill, last growth;
see :meth:`PublishJudge.note_route`), and the last decision, which the status shows.

Threads: the engine thread observes, notes and judges; :meth:`PublishJudge.status` may be
called from any thread and returns a value that the engine thread builds whole after each
change and replaces in one assignment, so a reader never iterates live state.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..events import RequestPrefilled, Route, SparseRouteServed
from ..settings import PublishPolicy
from .costs import (
    DEFAULT_APPEND_TOKENS,
    Decision,
    DenseCostModel,
    HostAppendFactor,
    Source,
    SparseSample,
    Verdict,
    decide,
    later_turn,
    sparse_rerun_seconds,
)
from .door_reading import DoorGrowth, door_growth
from .host_probe import HostCostProbe
from .jobs import RecoveryJob
from .machine_load import LoadReading, MachineLoad, Regime, carry_factor, contention_factor, demand_factor

# The keep share assumed when the host does not say (oMLX's default).
DEFAULT_KEEP = 0.2
# Sparse turns remembered per conversation and load regime: a publication is weighed
# against the cheapest of them, so one slow turn (a noisy machine, a first turn that read
# the whole prompt with the draft) never talks the policy into a dense turn that loses.
RECENT_SPARSE = 3
# Recent sparse turns within this factor per token of the latest are one cost seen through
# noise (turns of one conversation on this CPU differed by up to 1.4x); beyond it, the
# route itself changed, and the latest turn speaks for it alone.
NOISE_SPAN = 2.0
# How soon a conversation is expected back: the chance it has not returned halves every
# this many seconds (a production chat trace: median gap to the next turn 126 s, p90 480 s).
RETURN_HALF_LIFE_S = 180.0
# Growths remembered across conversations. A conversation that has not grown yet (its
# first gap) is expected to grow as the others on this server did; the upper quartile,
# because the first publication decides for every later turn (the host caches each dense
# turn, so the conversation stays dense), while a wrong hold costs one turn's saving.
SEEN_APPENDS = 16


@dataclass(slots=True)
class RouteMemory:
    """What the host said of one conversation's sparse route: ``threshold`` and ``keep``
    (None: unknown), ``sparse`` (its last measured sparse prefill in each load regime),
    ``last_append`` (how much the conversation grew at its last turn)."""

    threshold: int | None = None
    keep: float | None = None
    sparse: dict[Regime, SparseSample] = field(default_factory=dict)
    #: The last ``RECENT_SPARSE`` sparse turns in each regime, oldest first.
    recent: dict[Regime, tuple[SparseSample, ...]] = field(default_factory=dict)
    last_append: int | None = None
    #: What the last publication expected the next dense turn to cost (seconds), if any.
    predicted_dense_s: float | None = None
    #: When the host last served the conversation (the service's clock).
    served_at: float | None = None
    #: The host's door time per token on the conversation's first sparse turn (see
    #: :mod:`.door_reading`); None where the host reports no door.
    fresh_door_rate: float | None = None

    @property
    def kept_share(self) -> float:
        """The share of a prompt the host's sparse route keeps (``DEFAULT_KEEP`` where it
        did not say)."""
        return self.keep if self.keep is not None else DEFAULT_KEEP

    def remember(self, regime: Regime, sample: SparseSample) -> None:
        """A sparse turn measured in ``regime``: the latest, and one of the recent. The
        same request told twice (``request_prefilled`` at its first token, then
        ``sparse_route_served`` with the door's share) replaces its first sample."""
        self.sparse[regime] = sample
        recent = self.recent.get(regime, ())
        if recent and sample.request_id is not None and recent[-1].request_id == sample.request_id:
            recent = recent[:-1]
        self.recent[regime] = (*recent[-(RECENT_SPARSE - 1):], sample)

    def cheapest(self, regime: Regime, appended: int, growth: float = 0.0) -> SparseSample | None:
        """Of the recent sparse turns in ``regime``, each as a rerun that grew by
        ``appended`` tokens, whose door time per new token grows by ``growth`` per token
        read before (:meth:`SparseSample.as_rerun`), the one cheapest per token among
        those within ``NOISE_SPAN`` of the latest (older, much cheaper turns are a route
        that has since changed)."""
        samples = [x.as_rerun(appended, self.fresh_door_rate, growth) for x in self.recent.get(regime, ())]
        if not samples:
            return None

        def per_token(x: SparseSample) -> float:
            return x.seconds / max(1, x.tokens)

        latest = samples[-1]
        alike = [x for x in samples if per_token(latest) <= NOISE_SPAN * per_token(x)]
        return min(alike, key=per_token)


@dataclass(slots=True, frozen=True)
class _Carry:
    """A sparse turn measured in ``regime``, carried to the current one at ``factor``;
    ``record``: what the status shows of it."""

    regime: Regime
    factor: float
    record: dict[str, Any]


class PublishJudge:
    """Publish, hold or stand down, for one engine's jobs."""

    def __init__(
        self, policy: PublishPolicy, block_size: int, load: MachineLoad | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.block_size = block_size
        # One cost model per load regime: a loaded sample never answers for a quiet
        # machine, nor a quiet one for a loaded machine. ``costs`` is the current regime's.
        self._load = load if load is not None else MachineLoad()
        self._models = {regime: DenseCostModel() for regime in Regime}
        self.regime = Regime.QUIET
        self.costs = self._models[self.regime]
        self._switches = 0
        self.last: Decision | None = None
        # The verdict taken at the last request that continued a held conversation.
        self._at_request: Decision | None = None
        self._routes: dict[int, RouteMemory] = {}
        # The last ``SEEN_APPENDS`` growths of any conversation (engine thread).
        self._appends: deque[int] = deque(maxlen=SEEN_APPENDS)
        # What the host's own turns said of the predictions (engine thread).
        self._host_turns = 0
        self._host_append = HostAppendFactor()
        self._probe = HostCostProbe(clock)
        self._door = DoorGrowth()
        self._lookups_seen = False
        self._sparse_updates = 0
        self._last_turn: dict[str, Any] | None = None
        # The last sparse turn carried over from another load regime (status only).
        self._carried_last: dict[str, Any] | None = None
        self._status: MappingProxyType[str, Any] = self._build_status()

    def note_route(
        self, job: RecoveryJob, event: SparseRouteServed, appended: int | None, now: float | None = None
    ) -> None:
        """Remember what the host said of its sparse route for ``job``'s conversation
        (``appended``: how much the conversation grew with this turn, if it did; ``now``:
        when it was served)."""
        route = self._routes.setdefault(job.job_id, RouteMemory())
        if now is not None:
            route.served_at = now
        if event.threshold is not None:
            route.threshold = int(event.threshold)
        if event.keep is not None:
            route.keep = float(event.keep)
        regime = self._look()
        if event.prefill_s is not None and event.prefill_s > 0:
            self._note_door(route, event, appended)
            route.remember(regime, SparseSample(
                len(event.tokens) - event.served_start, float(event.prefill_s), self._load.reading, event.door_s,
                event.request_id,
            ))
        if appended is not None:
            route.last_append = appended
            if appended > 0:
                self._appends.append(appended)
                self._status = self._build_status()

    def _note_door(self, route: RouteMemory, event: SparseRouteServed, appended: int | None) -> None:
        """A sparse turn's door time: the conversation's rate per token at its first, how
        a new token's cost grew with the tokens read before at the later ones
        (:mod:`.door_reading`)."""
        tokens = len(event.tokens) - event.served_start
        if not event.door_s or event.door_s <= 0 or tokens <= 0:
            return
        if route.fresh_door_rate is None:
            if appended is None:  # a conversation's first turn: its door read every token
                route.fresh_door_rate = event.door_s / tokens
            return
        if appended:
            self._door.observe(door_growth(route.fresh_door_rate, event.door_s, tokens, appended))

    def next_append(self, route: RouteMemory) -> int:
        """How much ``route``'s conversation is expected to grow at its next turn: as it
        did at its last; before it has grown, the upper quartile of what the server's
        conversations grew by at their sparse turns and their dense turns over a cached
        prefix (see ``SEEN_APPENDS``); before any has, ``DEFAULT_APPEND_TOKENS``."""
        if route.last_append:
            return route.last_append
        if self._growth_guessed(route):
            return DEFAULT_APPEND_TOKENS
        seen = sorted(self._appends)
        return seen[max(0, math.ceil(0.75 * len(seen)) - 1)]

    def _growth_guessed(self, route: RouteMemory) -> bool:
        """Whether :meth:`next_append` for ``route`` is ``DEFAULT_APPEND_TOKENS``, a guess:
        neither the conversation nor any other on this server has grown yet."""
        return not route.last_append and not self._appends

    @property
    def evidence(self) -> int:
        """Grows whenever what the policy knows changes (a cost model's evidence, a sparse
        turn measured, the machine's load regime, a probe's wait run out): a verdict taken
        on less may be revisited."""
        return (sum(m.evidence for m in self._models.values()) + self._sparse_updates + self._switches
                + self._probe.lapsed)

    def keep_only(self, job_ids: Iterable[int]) -> None:
        """Forget the conversations whose jobs have left the book."""
        live = set(job_ids)
        for job_id in [j for j in self._routes if j not in live]:
            del self._routes[job_id]

    def observe(self, context: int, tokens: int, seconds: float) -> None:
        """A whole slice of ``tokens`` on top of ``context`` took ``seconds``."""
        self._models[self._look()].observe(context, tokens, seconds)
        self._status = self._build_status()

    def layer_seconds_bound(self, tokens: int, context: int) -> float | None:
        """Seconds of a dense pass, for how long an arriving request could wait on one of
        its layers: the current load regime's model, else the slower answer of another
        regime's (after the machine's load changes, the new regime's model is unfitted
        for some slices, and a pass sized on no cost at all ran whole layers of 256
        tokens: a request waited 0.95 s for one on the real server, 3072x2 at 9k)."""
        here = self.costs.seconds(tokens, context)
        if here is not None:
            return here
        others = [m.seconds(tokens, context) for m in self._models.values() if m is not self.costs]
        known = [x for x in others if x is not None]
        return max(known) if known else None

    def attention_wanted(self, job: RecoveryJob) -> int | None:
        """The context to time the model's attention at before ``job`` is worked on: its
        next prompt's expected length, where the pass over its whole prefix lies beyond
        the slices' evidence and nothing was timed near it (None: no probe wanted). Not
        while other processes load the machine: the probe's few queries are then timed
        mostly waiting for cores (2-core machine, two busy processes: 3.8-11.8 us a token
        per position against 0.5 quiet, where a pass of 600 queries read 1.0), and a
        4096x2 target that paid 2.2x stood down on it (bench policy, loaded cell)."""
        if self.policy is not PublishPolicy.AUTO or self._look() is Regime.BUSY:
            return None
        route = self._routes.get(job.job_id) or RouteMemory()
        full = job.publish_end(self.block_size)
        next_tokens = len(job.tokens) + self.next_append(route)
        if not self.costs.wants_attention(next_tokens - full, full):
            return None
        return next_tokens

    def look_at_load(self) -> None:
        """Read the machine's load now: a change of regime is new evidence, which reopens
        what was stood down or paused in the other one. Where no job runs a slice nothing
        else reads it until the next turn, and a stand-down taken under load held through
        the quiet idle time after it (bench policy, 4096x2 loaded: the quiet next turn
        would have paid 2.2x)."""
        before = self.regime
        self._look()
        if self.regime is not before:
            self._status = self._build_status()

    def observe_attention(self, context: int, seconds_per_token: float) -> None:
        """The model's attention was timed at ``context`` (:mod:`..runner.attention_probe`),
        on the machine as loaded as now."""
        self._models[self._look()].observe_attention(context, seconds_per_token)
        self._status = self._build_status()

    def observe_turn(self, job: RecoveryJob | None, event: RequestPrefilled) -> None:
        """The host prefilled a turn: its own dense append is the best evidence of what one
        costs here, and, after a publication, the check of what the policy expected."""
        uncached = len(event.tokens) - event.cached_tokens
        regime = self._look()
        if event.route is Route.DENSE and event.cached_tokens > 0 and uncached > 0:
            if uncached <= event.cached_tokens:
                # A conversation going on over its cached prefix (a new one sharing only
                # a system prompt has more new than cached): its growth, up to a block's
                # tail. A published conversation's turns are dense; their growth counts too.
                self._appends.append(uncached)
            model = self._models[regime]
            # Against the prediction before this turn's own sample is in the model.
            self._host_append.observe(model.seconds(uncached, event.cached_tokens), event.prefill_s)
            # The model is of the slices' cost, and a verdict multiplies it by the host's
            # factor: the host's turn goes in as the slices' pass it implies, or its
            # overhead would be counted twice where only the host has reached.
            factor = max(self._host_append.value, 1e-6)
            model.observe(event.cached_tokens, uncached, event.prefill_s / factor, Source.HOST)
            self._host_turns += 1
        route = self._routes.get(job.job_id) if job is not None else None
        if route is not None and event.route is Route.SPARSE and uncached > 0 and event.prefill_s > 0:
            route.remember(regime, SparseSample(uncached, event.prefill_s, self._load.reading,
                                                request_id=event.request_id))
            self._sparse_updates += 1
        if route is not None and route.predicted_dense_s is not None and event.route is Route.DENSE:
            keep = route.kept_share
            measured = self._sparse_sample(route, self._carried(route, keep))
            sparse = sparse_rerun_seconds(self.costs, len(event.tokens), keep, measured) if measured else None
            self._last_turn = {
                "cached_tokens": event.cached_tokens,
                "prefill_s": event.prefill_s,
                "predicted_s": route.predicted_dense_s,
                "sparse_s": sparse,
                "paid": None if sparse is None else event.prefill_s < sparse,
            }
            route.predicted_dense_s = None
        self._status = self._build_status()

    def expected_saving(self, job: RecoveryJob, now: float) -> float:
        """Seconds the conversation's next turn is expected to save once ``job`` is
        recovered in full, weighed by the chance the conversation comes back soon, per
        token recovery still has to run for it (0 where the sparse cost is not known)."""
        route = self._routes.get(job.job_id)
        if route is None:
            return 0.0
        full = job.publish_end(self.block_size)
        next_tokens = len(job.tokens) + self.next_append(route)
        keep = route.kept_share
        measured = self._sparse_sample(route, self._carried(route, keep))
        sparse = sparse_rerun_seconds(self.costs, next_tokens, keep, measured)
        if sparse is None:
            return 0.0
        dense = self.costs.seconds(max(0, next_tokens - full), full) or 0.0
        back = 1.0 if route.served_at is None else 0.5 ** (max(0.0, now - route.served_at) / RETURN_HALF_LIFE_S)
        remaining = max(1, full - job.frontier(self.block_size))
        return max(0.0, sparse - dense) * back / remaining

    @property
    def waits_for_arrival(self) -> bool:
        """Publications wait for the conversation's next request: the host has shown that
        it tells of each request before its prefix lookup (``prefix_lookup_due``), where
        the request's real length is known, and the policy judges."""
        return self.policy is PublishPolicy.AUTO and self._lookups_seen

    def note_lookup(self) -> None:
        """The host told of a request before its prefix lookup. The machine's load is read
        up to here: a verdict at the request is taken in the regime the machine is in now,
        and the turn that follows is timed in a window of its own. Before, a turn sent as
        a load ended was read together with the loaded idle time before it, counted busy,
        and carried to the quiet machine at the fair share (real oMLX, 2048x2: its rerun
        then read 2.45 s where the quiet sparse turns took 3.58-3.84 s)."""
        self._lookups_seen = True
        self._look()
        self._status = self._build_status()

    def judge(self, job: RecoveryJob, boundary: int, next_tokens: int | None = None) -> Decision:
        """What to do with ``job``'s finished blocks up to ``boundary``; ``next_tokens``: the
        length of the conversation's next prompt when it is known (it has arrived), else
        it is expected (:meth:`next_append`)."""
        if self.policy is PublishPolicy.ALWAYS:
            decision = Decision(Verdict.PUBLISH, "policy: always")
        else:
            route = self._routes.get(job.job_id) or RouteMemory()
            appended = self.next_append(route) if next_tokens is None else max(0, next_tokens - len(job.tokens))
            decision = self._weigh(
                job, route, boundary, self._reachable(job, route, boundary, next_tokens), appended,
                length_known=next_tokens is not None,
                may_probe=self._probe.may_probe(job.job_id, self._host_append.measured),
            )
            if decision.probes:
                self._probe.begin(job.job_id)
            if next_tokens is not None and decision.verdict is Verdict.STAND_DOWN:
                # At a request, the verdict is for that request alone, over what is held:
                # the job goes on in the next gap, where its whole prefix is judged.
                decision = Decision(
                    Verdict.HOLD, f"not published for this request over the {boundary} tokens held: "
                    f"a dense turn ({decision.dense_s:.2f} s) would cost more than its sparse route "
                    f"({decision.sparse_s:.2f} s)", decision.dense_s, decision.sparse_s,
                )
        self.last = decision
        if next_tokens is not None:
            self._at_request = decision
        memory = self._routes.get(job.job_id)
        if memory is not None and decision.verdict is Verdict.PUBLISH:
            memory.predicted_dense_s = decision.dense_s
        self._status = self._build_status()
        return decision

    def _weigh(
        self, job: RecoveryJob, route: RouteMemory, boundary: int, full_boundary: int, appended: int, *,
        length_known: bool, may_probe: bool,
    ) -> Decision:
        """:func:`decide` for ``job`` with the conversation growing by ``appended``."""
        keep = route.kept_share
        carried = self._carried(route, keep)
        if carried is not None:
            self._carried_last = carried.record
        measured, cheapest = self._sparse_sample(route, carried), self._cheapest(route, appended, carried)
        next_tokens = len(job.tokens) + appended
        factor = self._host_append.value
        later = later_turn(self.costs, next_tokens=next_tokens, growth=appended,
                           block_size=self.block_size, threshold=route.threshold, keep=keep, measured=measured,
                           cheapest=cheapest, host_factor=factor)
        decision = decide(
            self.costs,
            boundary=boundary,
            full_boundary=full_boundary,
            next_tokens=next_tokens,
            threshold=route.threshold,
            keep=keep,
            measured=measured,
            cheapest=cheapest,
            measured_here=self.regime in route.sparse,
            host_factor=factor,
            may_probe=may_probe,
            length_known=length_known,
            whole_boundary=job.publish_end(self.block_size),
            carried_down=carried is not None and carried.regime is Regime.BUSY and self.regime is Regime.QUIET,
            host_measured=self._host_append.measured > 0,
            later=later,
        )
        return replace(decision, later=later)

    def _length_decides(self, job: RecoveryJob) -> bool:
        """Whether the next prompt's length, not known yet, decides the verdict on ``job``'s
        whole prefix: nothing on this server has grown yet (the growth judged is
        ``DEFAULT_APPEND_TOKENS``, a guess), the verdict waits for the request (where the
        length is known), and a growth of one block would publish. Then a hold "not yet
        clear" at the guess is no reason to stop: on 2048x4 (lab order) jobs paused there
        one block short of whole, where the schedule's real growth of 256 paid by 1.6x."""
        route = self._routes.get(job.job_id) or RouteMemory()
        if not self.waits_for_arrival or not self._growth_guessed(route):
            return False
        whole = job.publish_end(self.block_size)
        short = self._weigh(job, route, whole, whole, self.block_size, length_known=False, may_probe=False)
        return short.verdict is Verdict.PUBLISH

    def _reachable(self, job: RecoveryJob, route: RouteMemory, boundary: int, next_tokens: int | None) -> int:
        """The longest prefix the next turn can find recovered: the job's whole prefix,
        or, once the turn has arrived and will be dense over ``boundary``, ``boundary``
        (nothing more is run before it). Under a turn that stays sparse a partial prefix
        stays a partial one: it would cost that turn its draft's reading."""
        if next_tokens is None:
            return job.publish_end(self.block_size)
        if route.threshold is not None and next_tokens - boundary > route.threshold:
            return job.publish_end(self.block_size)
        return boundary

    def before_work(self, job: RecoveryJob) -> Decision | None:
        """The verdict on ``job``'s whole prefix, taken before more of it is run: a
        stand-down, or a hold that more slices would not change (:attr:`Decision.settled`),
        says not to run it now, unless the next prompt's length decides it
        (:meth:`_length_decides`). None until the dense cost is known, or when the policy
        does not judge."""
        if self.policy is not PublishPolicy.AUTO or not self.costs.fitted:
            return None
        decision = self.judge(job, job.publish_end(self.block_size))
        if decision.verdict is Verdict.HOLD and decision.settled and self._length_decides(job):
            decision = replace(decision, settled=False, reason=f"{decision.reason}; run on: the next prompt's "
                               f"length decides (a growth of {self.block_size} would publish)")
            self.last = decision
            self._status = self._build_status()
        return decision

    def status(self) -> MappingProxyType[str, Any]:
        """The policy's status as of its last change (any thread)."""
        return self._status

    def _look(self) -> Regime:
        """The machine's load regime now (kept where it cannot be told); a change of
        regime switches the cost model that answers."""
        regime = self._load.look()
        if regime is not None and regime is not self.regime:
            self.regime, self.costs = regime, self._models[regime]
            self._switches += 1
        return self.regime

    def _sparse_sample(self, route: RouteMemory, carried: _Carry | None) -> SparseSample | None:
        """The conversation's sparse turn as it would cost in the current regime: one
        measured in it; else one measured in the other regime, ``carried`` over
        (:meth:`_carried`); else None."""
        own = route.sparse.get(self.regime)
        if own is not None:
            return own
        if carried is None:
            return None
        return route.sparse[carried.regime].scaled(carried.factor)

    def _cheapest(self, route: RouteMemory, appended: int, carried: _Carry | None) -> SparseSample | None:
        """The cheapest recent sparse turn as a rerun that grew by ``appended``
        (:meth:`RouteMemory.cheapest`), in the current regime; where none was measured in
        it, the other regime's, carried over as the latest is: a carried-over first turn
        counts its door's reading of the whole prompt, which a rerun does not pay."""
        if self.regime in route.recent:
            return route.cheapest(self.regime, appended, self._door.value)
        if carried is None:
            return None
        cheapest = route.cheapest(carried.regime, appended, self._door.value)
        return None if cheapest is None else cheapest.scaled(carried.factor)

    def _carried(self, route: RouteMemory, keep: float) -> _Carry | None:
        """The regime a sparse turn of the conversation was measured in, and the factor that
        carries it to the current one (:func:`carry_factor`: the two regimes' dense costs
        compared at its kept share where both have evidence there, the others' demand and
        this process's threads' contention in each); None where it cannot be told, or where
        the current regime has its own turn. :meth:`judge` shows in the status the last one
        a verdict took."""
        if self.regime in route.sparse and self.regime in route.recent:
            return None
        now = self._load.reading
        for regime, sample in route.sparse.items():
            if regime is self.regime:
                continue
            kept = max(1, round(keep * sample.tokens))
            here, there = self.costs.seconds(kept, 0), self._models[regime].seconds(kept, 0)
            # Compared only where both regimes' slices reached: a job's frontier moves on,
            # so the regime it switched to has seen other contexts, and two fits read
            # beyond their evidence differed from what the load did by 0.3-2.7x (bench policy).
            comparable = self.costs.spans(kept, 0) and self._models[regime].spans(kept, 0)
            by_costs = here / there if here and there and comparable else None
            by_demand = demand_factor(sample.load, now)
            by_contention = contention_factor(sample.load, now)
            factor = carry_factor(by_costs, by_demand, by_contention)
            if factor is None:
                continue
            return _Carry(regime, factor, {
                "from": regime.value, "tokens": sample.tokens, "seconds": round(sample.seconds, 4),
                "door_s": None if sample.door_s is None else round(sample.door_s, 4),
                "factor": round(factor, 4),
                "by_dense_costs": None if by_costs is None else round(by_costs, 4),
                "by_demand": None if by_demand is None else round(by_demand, 4),
                "by_contention": None if by_contention is None else round(by_contention, 4),
                "load_then": _reading_status(sample.load), "load_now": _reading_status(now),
            })
        return None

    def _build_status(self) -> MappingProxyType[str, Any]:
        coefficients = self.costs.coefficients()
        decision = self.last
        return MappingProxyType(
            {
                "mode": self.policy.value,
                "load_regime": self.regime.value,
                "others_load_share": self._load.last_share,
                # The others' demand and this process's contention in this regime.
                "load": _reading_status(self._load.reading),
                "regime_switches": self._switches,
                "dense_cost_samples": self.costs.samples,
                "host_dense_samples": self.costs.host_samples,
                "evidence": self.evidence,
                "host_turns_learned": self._host_turns,
                # The host's dense append over the slices' estimate, and how many of the
                # host's own dense turns measured it (0: the prior).
                "host_append_factor": round(self._host_append.value, 4),
                "host_append_measured": self._host_append.measured,
                # The job published (or being run to be) to measure the host's factor.
                "host_probe": self._probe.status(),
                # Publications wait for the conversation's next request (its real length).
                "publishes_at_arrival": self.waits_for_arrival,
                # What a conversation that has not grown yet is expected to grow by.
                "new_conversation_append": self.next_append(RouteMemory()),
                # How much a new token's door time grows per 1,000 tokens the door read
                # before (a share of a first turn's rate), and how many sparse reruns
                # measured it (0: the re-reading counted as free).
                "door_growth_per_1k_read": round(1000 * self._door.value, 4),
                "door_growth_measured": self._door.measured,
                "last_turn_after_publication": dict(self._last_turn) if self._last_turn else None,
                "dense_s_per_token": coefficients[0] if coefficients else None,
                "dense_s_per_token_per_context": coefficients[1] if coefficients else None,
                # Attention's own cost per token per position, timed at the deepest
                # context a verdict needed (None: not timed in this regime).
                "attention_s_per_token_per_context": self.costs.attention_slope(0.0),
                "verdict": decision.verdict.value if decision else None,
                "reason": decision.reason if decision else None,
                "dense_append_s": decision.dense_s if decision else None,
                "sparse_rerun_s": decision.sparse_s if decision else None,
                # The turn after next the last verdict weighed: a publication commits it
                # to the dense route (its dense append at the host's factor).
                "turn_after_next": _later_status(decision),
                # The last sparse turn carried over from the other load regime, and how.
                "sparse_carried_over": self._carried_last,
                # What the last request that continued a held conversation was given
                # (later verdicts in idle time replace ``verdict`` and ``reason``).
                "at_last_request": None if self._at_request is None else {
                    "verdict": self._at_request.verdict.value, "reason": self._at_request.reason,
                    "dense_append_s": self._at_request.dense_s, "sparse_rerun_s": self._at_request.sparse_s,
                },
            }
        )


def _later_status(decision: Decision | None) -> dict[str, float] | None:
    later = None if decision is None else decision.later
    if later is None:
        return None
    return {"prompt_tokens": later.prompt_tokens, "uncached_tokens": later.tokens,
            "dense_append_s": round(later.dense_s * later.host_factor, 4), "sparse_rerun_s": round(later.sparse_s, 4),
            "host_factor": round(later.host_factor, 4)}


def _reading_status(reading: LoadReading | None) -> dict[str, float] | None:
    if reading is None:
        return None
    return {"share": round(reading.share, 4), "demand": round(reading.demand, 4),
            "contention": round(reading.contention, 4)}
