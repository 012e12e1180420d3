"""When publishing pays: what the next turn costs on each route, from what recovery measures.

Recovery only helps if the turn that restores its prefix is cheaper than the route the
host would otherwise take. A host with a sparse route sends a turn down it only when the
turn's *uncached* part exceeds the host's threshold, so a partly recovered prefix can
flip the next turn to a dense prefill of the rest, over a long context: on a model whose
cost grows steeply with context (attention-bound), that is slower than the sparse rerun
it replaced. This module estimates both sides and says whether to publish, hold the
finished blocks back, or stand down:

* :class:`DenseCostModel` learns the seconds of a dense pass of ``n`` tokens on top of
  ``c`` cached ones, ``a*n + b*(n*c + n*n/2)`` (matrix products per token, plus attention
  per token per attended position), from the recovery slices themselves and from the
  host's own dense appends (the same model, on the same machine), each context band
  speaking through its quietest sample; :meth:`DenseCostModel.estimate` bounds an answer
  by where the evidence lies, and has no upper bound beyond it; its lower bound there
  grows by what attention was timed to cost at that depth (:mod:`..runner.attention_probe`).
* :func:`sparse_rerun_seconds`: the host's measured sparse prefill time, scaled to the
  next turn's length; without a measurement, the target's share of it (the kept tokens'
  dense prefill), which leaves out the draft and so errs towards the sparse route.
* :class:`HostAppendFactor`: how much the host's own cached dense append costs over what
  the slices predict for the same pass (the host restores the cached blocks and prefills
  the turn its own way), learned from the host's dense turns, with a prior until one is
  seen.
* :func:`decide` compares the next turn's dense append over the prefix that publication
  would leave, as the host would run it, with the sparse rerun: it publishes what surely
  pays, stands down only when even the full prefix is confidently slower by the margin
  (slower by less, it holds what it has), and otherwise holds for more evidence; while
  the host's factor is still the prior, a whole prefix that only the prior holds back may
  be published once to measure it (:mod:`.host_probe`).

Threads: a :class:`DenseCostModel` belongs to one engine's recovery service and is used on
its engine thread only (the status copies its coefficients under the service's lock).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from .door_reading import rerun_door_seconds
from .machine_load import LoadReading

# Publish only when the dense append is estimated at no more than this share of the
# sparse rerun: estimates are noisy, and a wrong "yes" makes a turn slower than sparse.
PAYS_MARGIN = 0.9
# The next turn's growth when a conversation has not yet shown one (agents append a
# reply, a tool's output and a question: a few hundred tokens).
DEFAULT_APPEND_TOKENS = 512
# Slices the model needs, at this many distinct contexts, before its answer is trusted.
MIN_SAMPLES = 3
# Slices remembered; old ones fall out as the machine's load changes.
MAX_SAMPLES = 64
# Recent samples a context band keeps (its quietest speaks for it).
BAND_SAMPLES = 8
# The smallest relative scatter an estimate is given (timings are never exact).
MIN_SCATTER = 0.05
# How far past the furthest band seen an estimate still counts as supported.
SUPPORT_REACH = 1.25
# The host's cached dense append over the slices' estimate of the same pass, before the
# host has run one. The policy's own measurement of it (the host's prefill time over the
# estimate at the turn's real length) read 1.00-1.01 on the real oMLX server and 1.01 on
# its scheduler in process (bench policy, 4096x2 at 8,704). An earlier prior of 1.3 was
# read from bench policy cells as time to first token over the estimate the policy makes
# for the 512 tokens it assumes before a conversation has grown, where the turn added 600:
# per token 1.03-1.23x, upper quartile 1.19, time to first token included. 1.2 keeps that
# caution (a close call waits for the host's first dense turn, or the probe) without the
# length mismatch; a host that turns out cheaper replaces the prior at its first dense
# turn, which the host probe (:mod:`.host_probe`) makes sure comes.
HOST_APPEND_PRIOR = 1.2
# Where the next prompt has arrived (its real length known, so the prior's length caution
# does not apply), the probe may go out while at the prior's expected cost the dense turn
# is up to this factor of the sparse rerun: if the prior were right, one turn 5 % slower;
# at the factors measured at real lengths (1.00-1.09 on oMLX's server and scheduler, quiet
# and loaded) it pays by 4-15 %.
PROBE_BAR_AT_ARRIVAL = 1.05
# The host's dense turns whose ratio to the prediction is remembered (their median speaks).
HOST_APPEND_SAMPLES = 8


class Verdict(str, Enum):
    PUBLISH = "publish"
    HOLD = "hold"  # keep finished blocks back until a longer prefix pays
    STAND_DOWN = "stand_down"  # even a full prefix would not pay: stop recovering


@dataclass(frozen=True)
class LaterTurn:
    """A published conversation's turn after next: a ``prompt_tokens``-token prompt whose
    dense append of ``tokens`` costs ``dense_s`` at the slices' cost (a verdict scales it
    by the host's factor), and ``sparse_s`` the cheaper of the reruns the latest and the
    cheapest recent sparse turn imply; ``host_factor`` is the factor the verdict weighed it
    at (the judge's, when it weighed)."""

    prompt_tokens: int
    tokens: int
    dense_s: float
    sparse_s: float
    host_factor: float = 1.0


@dataclass(slots=True, frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    dense_s: float | None = None
    sparse_s: float | None = None
    #: A hold that may publish instead when holding would pass the memory cap: the next
    #: turn stays sparse either way, and published blocks bring the full prefix closer.
    may_spill: bool = False
    #: A hold of the whole prefix that more slices of the job would not change: the
    #: evidence already reaches the whole prefix, and what is unclear is the comparison.
    settled: bool = False
    #: A publication taken to measure the host's dense append (:mod:`.host_probe`).
    probes: bool = False
    #: The turn after next the verdict weighed (:func:`later_turn`; None: not weighed).
    later: LaterTurn | None = None


@dataclass(slots=True, frozen=True)
class SparseSample:
    """The host's sparse prefill of a ``tokens``-token prompt took ``seconds``, with the
    machine loaded as ``load`` says (None: not known)."""

    tokens: int
    seconds: float
    load: LoadReading | None = None
    door_s: float | None = None  # of ``seconds``, the host's scoring at its door (see SparseRouteServed)
    request_id: str | None = None  # the host's request: one turn reported by two hooks is one sample

    def as_rerun(self, appended: int, fresh_rate: float | None = None, growth: float = 0.0) -> SparseSample:
        """What the same turn would cost as a rerun that grew by ``appended`` tokens on a
        host that keeps its door's reading of the prompt (oMLX's draft cache): the door's
        time for the new tokens, each at ``fresh_rate`` seconds (default: this turn's door
        per token) raised by ``growth`` of that per token read before (see
        :mod:`.door_reading`). With ``growth`` 0, a lower bound of the rerun, so it may
        only ever hold a publication back."""
        if not self.door_s or self.tokens <= 0:
            return self
        door = min(self.door_s, self.seconds)
        if fresh_rate:
            again = rerun_door_seconds(fresh_rate, appended, self.tokens, growth)
        else:  # this turn's own rate, at most its whole door for the new tokens
            again = rerun_door_seconds(door / self.tokens, min(appended, self.tokens), self.tokens, growth)
        return SparseSample(self.tokens, self.seconds - door + again, self.load, request_id=self.request_id)

    def scaled(self, factor: float) -> SparseSample:
        """The same turn at ``factor`` times its time (its door's share with it): a turn
        carried over from another load regime."""
        return SparseSample(self.tokens, self.seconds * factor, self.load,
                            None if self.door_s is None else self.door_s * factor, self.request_id)


class Source(str, Enum):
    """Where a dense-cost sample came from."""

    SLICE = "slice"  # a recovery slice at its job's frontier
    HOST = "host"  # the host's own cached dense append of a turn, seen through the adapter


@dataclass(slots=True, frozen=True)
class Estimate:
    """Seconds of a dense pass, with the uncertainty of where the evidence lies.

    ``low`` and ``high`` bound it; ``high`` is infinite where the pass attends further
    than any sample did (``supported`` False): what attention costs there is not known."""

    low: float
    mid: float
    high: float
    supported: bool


@dataclass(slots=True)
class _Band:
    """Recent samples whose tokens attend over about the same positions, as (per-token
    rate, mean attended position); the fastest speaks for the band (load only ever slows
    a pass down)."""

    samples: deque[tuple[float, float]]

    @property
    def quiet(self) -> float:
        return min(rate for rate, _ in self.samples)

    @property
    def at(self) -> float:
        return min(self.samples)[1]


class DenseCostModel:
    """Seconds of a dense pass of ``n`` tokens over ``c`` cached ones:
    ``n * (a + b * (c + n/2))``, fitted to the quietest sample of each context band.

    Every sample, a recovery slice's or one of the host's own dense appends, is a per-token
    rate at its mean attended position ``c + n/2``. Samples are grouped into bands of
    attended positions (a quarter octave each), and each band speaks through its fastest
    recent sample: a burst of load on the machine slows some samples and never speeds one
    up, so it cannot make the model think the machine is slower than it is once a quiet
    sample has been seen there, and a band whose samples were all taken under load is
    corrected by its next quiet one. :meth:`estimate` says how far to trust an answer: near
    the bands seen, the bands' scatter around the fit; beyond them, only a lower bound
    (cost never falls as context grows) and no upper one.
    """

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._samples: deque[tuple[int, int, float, Source]] = deque(maxlen=max_samples)
        self._bands: dict[int, _Band] = {}
        self._coefficients: tuple[float, float] | None = None
        # Attention probes: band key -> (context, fastest seconds per token per position).
        self._attention: dict[int, tuple[int, float]] = {}
        #: Grows whenever the evidence changes what the model says (a new band, a faster
        #: sample in one): a verdict taken on older evidence may be revisited.
        self.evidence = 0

    def observe(self, context: int, tokens: int, seconds: float, source: Source = Source.SLICE) -> None:
        """A dense pass of ``tokens`` on top of ``context`` cached tokens took ``seconds``."""
        if tokens <= 0 or context < 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        self._samples.append((int(context), int(tokens), float(seconds), source))
        at = context + tokens / 2.0
        key = _band_key(at)
        band = self._bands.get(key)
        if band is None:
            self._bands[key] = _Band(deque([(seconds / tokens, at)], maxlen=BAND_SAMPLES))
            self.evidence += 1
        else:
            before = band.quiet
            band.samples.append((seconds / tokens, at))
            if band.quiet != before:
                self.evidence += 1
        self._coefficients = None

    def observe_attention(self, context: int, seconds_per_token: float) -> None:
        """The attention of all the model's layers was timed at ``seconds_per_token`` per
        token of a pass over ``context`` positions (:mod:`..runner.attention_probe`)."""
        if context <= 0 or not (math.isfinite(seconds_per_token) and seconds_per_token > 0):
            return
        key = _band_key(context)
        slope = seconds_per_token / context
        old = self._attention.get(key)
        if old is None or slope < old[1]:
            self._attention[key] = (int(context), slope)
            self.evidence += 1

    def attention_slope(self, at: float) -> float | None:
        """Seconds per token per attended position that attention was timed at, at or
        near ``at`` (the fastest probe at least ``at / SUPPORT_REACH`` deep); None where
        none was."""
        slopes = [slope for context, slope in self._attention.values() if context * SUPPORT_REACH >= at]
        return min(slopes) if slopes else None

    def wants_attention(self, tokens: int, context: int) -> bool:
        """Whether a pass of ``tokens`` over ``context`` lies beyond the slices' evidence
        with no attention probe near it: where a probe would bound its cost from below."""
        at = context + tokens / 2.0
        return (tokens > 0 and self.fitted and at > SUPPORT_REACH * self.support
                and self.attention_slope(at) is None)

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def host_samples(self) -> int:
        return sum(1 for *_, source in self._samples if source is Source.HOST)

    @property
    def fitted(self) -> bool:
        contexts = {c for c, *_ in self._samples}
        return len(self._samples) >= MIN_SAMPLES and len(contexts) >= MIN_SAMPLES

    @property
    def support(self) -> float:
        """The furthest mean attended position any band has seen (0 with no samples): of
        any of its recent samples, not only of the fastest one, which speaks for the band's
        rate; else a faster sample a little lower in the top band would take support away
        from what was already measured (a whole prefix held "not yet clear" at the end of
        the probe's own run)."""
        return max(self._attended(), default=0.0)

    def spans(self, tokens: int, context: int) -> bool:
        """A pass of ``tokens`` over ``context`` attends within the positions the samples
        saw (from :data:`SUPPORT_REACH` below the nearest to as far past the furthest):
        where the model's answer is a reading of evidence, not an extrapolation."""
        at = context + tokens / 2.0
        nearest = min(self._attended(), default=None)
        return nearest is not None and nearest / SUPPORT_REACH <= at <= SUPPORT_REACH * self.support

    def _attended(self) -> Iterator[float]:
        """The mean attended position of every recent sample of every band."""
        return (at for band in self._bands.values() for _, at in band.samples)

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per token, and per token per attended position; None until
        :attr:`fitted`. Both are kept non-negative."""
        if not self.fitted:
            return None
        if self._coefficients is None:
            self._coefficients = _fit([(band.at, band.quiet) for band in self._bands.values()])
        return self._coefficients

    def seconds(self, tokens: int, context: int) -> float | None:
        """The fit's answer (see :meth:`estimate` for how far to trust it)."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return pass_seconds(coefficients, tokens, context)

    def scatter(self) -> float:
        """The bands' relative scatter around the fit (at least :data:`MIN_SCATTER`)."""
        coefficients = self.coefficients()
        if coefficients is None or len(self._bands) < 2:
            return MIN_SCATTER
        a, b = coefficients
        errors = [((band.quiet - (a + b * band.at)) / max(band.quiet, 1e-12)) ** 2 for band in self._bands.values()]
        return max(MIN_SCATTER, math.sqrt(sum(errors) / len(errors)))

    def estimate(self, tokens: int, context: int) -> Estimate | None:
        """Seconds of ``tokens`` over ``context`` cached tokens, bounded; None until fitted."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        if tokens <= 0:
            return Estimate(0.0, 0.0, 0.0, True)
        a, b = coefficients
        mid = pass_seconds(coefficients, tokens, context)
        spread = 2.0 * self.scatter()
        top = self.support
        if context + tokens / 2.0 <= SUPPORT_REACH * top:
            return Estimate(max(0.0, mid * (1.0 - spread)), mid, mid * (1.0 + spread), True)
        # Beyond the evidence: a token costs at least what one at the furthest band did,
        # plus what attention was timed to add from there (on an attention-bound model
        # the furthest band's rate alone was half the host's real cost).
        at = context + tokens / 2.0
        slope = self.attention_slope(at) or 0.0
        low = tokens * (a + b * top + slope * max(0.0, at - top)) * max(0.0, 1.0 - spread)
        return Estimate(low, max(mid, low), math.inf, False)


class HostAppendFactor:
    """The host's cached dense appends over the slice-fitted prediction of each: the
    median of the recent ratios, else :data:`HOST_APPEND_PRIOR`."""

    def __init__(self, prior: float = HOST_APPEND_PRIOR, samples: int = HOST_APPEND_SAMPLES) -> None:
        self.prior = prior
        self._ratios: deque[float] = deque(maxlen=samples)

    def observe(self, predicted_s: float | None, actual_s: float) -> None:
        """The host ran a dense append the model predicted at ``predicted_s`` (before the
        host's own sample of it was added) in ``actual_s``."""
        if predicted_s is not None and predicted_s > 0 and math.isfinite(actual_s) and actual_s > 0:
            self._ratios.append(actual_s / predicted_s)

    @property
    def measured(self) -> int:
        return len(self._ratios)

    @property
    def value(self) -> float:
        return statistics.median(self._ratios) if self._ratios else self.prior


def _band_key(at: float) -> int:
    """The band of attended positions ``at`` falls in: a quarter octave each."""
    return round(4 * math.log2(1.0 + at / 128.0))


def _scaled(estimate: Estimate, factor: float) -> Estimate:
    return Estimate(estimate.low * factor, estimate.mid * factor, estimate.high * factor, estimate.supported)


def pass_seconds(coefficients: tuple[float, float], tokens: int, context: int) -> float:
    """Seconds of a dense pass of ``tokens`` over ``context`` cached ones at the fit
    ``coefficients`` (``(a, b)`` of :meth:`DenseCostModel.coefficients`)."""
    if tokens <= 0:
        return 0.0
    a, b = coefficients
    return tokens * (a + b * (context + tokens / 2.0))


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of ``rate = a + b * at`` for two non-negative coefficients (a tiny
    active-set solve)."""
    n = float(len(points))
    sx = sum(x for x, _ in points)
    sxx = sum(x * x for x, _ in points)
    sy = sum(y for _, y in points)
    sxy = sum(x * y for x, y in points)
    det = n * sxx - sx * sx
    if det > 1e-12 * max(1.0, n * sxx):
        a = (sy * sxx - sx * sxy) / det
        b = (n * sxy - sx * sy) / det
        if a >= 0 and b >= 0:
            return a, b
    # One coefficient at 0: keep whichever single-term fit explains more.
    a_only = sy / n if n else 0.0
    b_only = sxy / sxx if sxx else 0.0
    resid_a = sum((y - a_only) ** 2 for _, y in points)
    resid_b = sum((y - b_only * x) ** 2 for x, y in points)
    return (max(a_only, 0.0), 0.0) if resid_a <= resid_b else (0.0, max(b_only, 0.0))


def sparse_rerun_seconds(
    model: DenseCostModel,
    prompt_tokens: int,
    keep: float,
    measured: SparseSample | None,
) -> float | None:
    """Estimated seconds of the host's sparse prefill of a ``prompt_tokens``-token prompt
    with nothing cached: a measured sample scaled by the target's share, else the target's
    share alone (kept tokens prefilled densely over one another)."""
    estimate = model.seconds(math.ceil(keep * prompt_tokens), 0)
    if measured is None:
        return estimate
    if estimate is None:
        return measured.seconds * prompt_tokens / max(1, measured.tokens)
    at_sample = model.seconds(math.ceil(keep * measured.tokens), 0) or 0.0
    if at_sample <= 0:
        return measured.seconds * prompt_tokens / max(1, measured.tokens)
    return measured.seconds * estimate / at_sample


def later_turn(
    model: DenseCostModel,
    *,
    next_tokens: int,
    growth: int,
    block_size: int,
    threshold: int | None,
    keep: float,
    measured: SparseSample | None,
    cheapest: SparseSample | None,
    host_factor: float = 1.0,
) -> LaterTurn | None:
    """The turn after next of a conversation whose prefix is published: the host caches a
    dense turn's prompt to its last whole block, so each later turn appends its growth
    plus the tail the block left uncached the turn before, half a block on average, where
    the next turn's tail is whatever its prompt left (from none to a block less one). None
    where it cannot be told or stays sparse (its uncached part over ``threshold``).
    ``host_factor``: the factor the verdict weighs it at, kept with it for the status."""
    if growth <= 0 or block_size <= 0:
        return None
    tokens = growth + block_size // 2
    if threshold is not None and tokens > threshold:
        return None
    prompt = next_tokens + growth
    dense = model.estimate(tokens, prompt - tokens)
    beat = _rerun_to_beat(model, prompt, keep, sparse_rerun_seconds(model, prompt, keep, measured), cheapest)
    if dense is None or beat is None:
        return None
    return LaterTurn(prompt, tokens, dense.mid, beat, host_factor)


def _rerun_to_beat(
    model: DenseCostModel, prompt: int, keep: float, latest: float | None, cheapest: SparseSample | None,
) -> float | None:
    """The sparse rerun of a ``prompt``-token turn that a publication must beat: the
    cheaper of ``latest`` (the latest sparse turn's) and the one ``cheapest`` implies."""
    floor = sparse_rerun_seconds(model, prompt, keep, cheapest) if cheapest is not None else None
    return latest if latest is None or floor is None else min(latest, floor)


def decide(
    model: DenseCostModel,
    *,
    boundary: int,
    full_boundary: int,
    next_tokens: int,
    threshold: int | None,
    keep: float,
    measured: SparseSample | None,
    margin: float = PAYS_MARGIN,
    measured_here: bool = True,
    cheapest: SparseSample | None = None,
    host_factor: float = 1.0,
    may_probe: bool = False,
    length_known: bool = False,
    whole_boundary: int | None = None,
    carried_down: bool = False,
    host_measured: bool = True,
    later: LaterTurn | None = None,
) -> Decision:
    """Publish a prefix of ``boundary`` tokens now, hold it back, or stand down.

    ``next_tokens`` is the expected length of the conversation's next prompt,
    ``full_boundary`` the longest prefix recovery can reach, ``threshold`` the host's
    sparse threshold on uncached tokens (None: unknown, so assume the next turn is
    prefilled densely over whatever is cached). ``measured_here``: ``measured`` was
    timed on the machine as it is now (not carried over from another load regime); a
    stand-down needs it. ``cheapest``: the cheapest per token of the conversation's recent
    sparse turns in this regime; a publication must beat the rerun it implies too, while a
    stand-down weighs the latest (each errs on the side of leaving the host's route be).
    ``host_factor``: the host's dense append over the slices' estimate
    (:class:`HostAppendFactor`); a publication is judged at the host's cost, a stand-down
    at the slices' (the cheaper reading: again the side of doing nothing drastic).
    ``may_probe``: ``host_factor`` is a prior, not a measurement, and this job may be the
    one published to measure it (:mod:`.host_probe`): a whole prefix that the prior alone
    holds back (the slices' own estimate pays by the margin) and that at the prior's
    expected cost is no slower than the sparse rerun is published; ``length_known`` (the
    next prompt has arrived): one that at the prior's expected cost is at most
    :data:`PROBE_BAR_AT_ARRIVAL` times the rerun; either on a sparse cost timed in the
    current load regime (``measured_here``), the one at arrival also on one
    ``carried_down`` (timed with the machine busy, carried to it quiet). ``host_measured``:
    ``host_factor`` was measured on the host's own dense turns (False: it is the prior); a
    whole prefix that only the prior holds back is not :attr:`Decision.settled`.
    ``whole_boundary``: the job's whole prefix (None: ``full_boundary``); only a prefix
    that reaches it is published before the costs are known (at a request
    ``full_boundary`` is what is held, however short). ``later``: the conversation's turn
    after next (:func:`later_turn`); a publication commits the later turns to the dense
    route too, so one judged once the costs are known must pay there as well."""
    uncached = next_tokens - boundary
    if threshold is not None and uncached > threshold:
        if boundary >= full_boundary:
            return Decision(Verdict.PUBLISH, f"next turn stays sparse ({uncached} uncached > {threshold})")
        # A partial prefix under a turn that stays sparse saves only the kept share of its
        # tokens, and costs a host that caches its draft's reading by the uncached part
        # (oMLX) that reading: measured, 256 cached made the sparse turn 4.4x slower.
        return Decision(Verdict.HOLD, f"a {boundary}-token prefix leaves the next turn sparse ({uncached} "
                        f"uncached > {threshold}); holding until {full_boundary}", may_spill=True)
    slices = model.estimate(uncached, boundary)
    dense = None if slices is None else _scaled(slices, max(host_factor, 0.0))
    sparse = sparse_rerun_seconds(model, next_tokens, keep, measured)
    # A publication is weighed against the cheapest recent rerun, a stand-down against
    # the latest: each errs towards leaving the host's own route alone.
    beat = _rerun_to_beat(model, next_tokens, keep, sparse, cheapest)
    if dense is None or sparse is None or beat is None:
        if boundary >= (full_boundary if whole_boundary is None else whole_boundary):
            return Decision(Verdict.PUBLISH, "full prefix; dense cost not yet learned")
        return Decision(Verdict.HOLD, "learning the dense cost before a partial prefix is published")
    host = "" if host_factor == 1.0 else f", the host's: {host_factor:.2f}x the slices'"
    def commits(bar: float, factor: float = host_factor) -> bool:
        return later is None or later.dense_s * factor <= bar * later.sparse_s

    later_why = "" if commits(margin) or later is None else (
        f"; once published its later turns are dense too: the turn after next "
        f"{later.dense_s * host_factor:.2f} s against sparse {later.sparse_s:.2f} s")
    if dense.high <= margin * beat and commits(margin):
        return Decision(
            Verdict.PUBLISH, f"dense append {dense.mid:.2f} s (at most {dense.high:.2f}{host}) < sparse rerun "
            f"{beat:.2f} s", dense.mid, beat,
        )
    full = model.estimate(max(0, next_tokens - full_boundary), full_boundary)
    assert full is not None  # fitted, as dense is
    if full.low > sparse and not measured_here:
        return Decision(
            Verdict.HOLD,
            f"a cached dense append ({full.mid:.2f} s) looks slower than a sparse rerun ({sparse:.2f} s), but "
            "the sparse route has not been timed with the machine as loaded as now; held for a measurement",
            full.mid, sparse,
        )
    if sparse < full.low <= sparse / margin:
        # Slower, but within the margin a publication must clear the other way: a stand-down
        # would drop what is held, and its conversation's next turn, judged at its real
        # length, may pay (bench server, 768x6: 9,472 held tokens dropped on 6.09 s against
        # 6.05 s, where the host's dense turn took 6.4 s against sparse 6.3-6.7 s).
        return Decision(
            Verdict.HOLD,
            f"a cached dense append ({full.mid:.2f} s, at least {full.low:.2f}) is slower than a sparse rerun "
            f"({sparse:.2f} s), but by less than the margin: too close to stand down; held",
            full.mid, sparse, settled=True,
        )
    if full.low > sparse:
        # Confidently slower: even the cheapest reading of the evidence loses to sparse by
        # more than the margin.
        return Decision(
            Verdict.STAND_DOWN,
            f"a cached dense append ({full.mid:.2f} s, at least {full.low:.2f}) costs more than a "
            f"sparse rerun ({sparse:.2f} s) on this model and machine",
            full.mid,
            sparse,
        )
    if boundary < full_boundary:
        why = (
            f"would make the next turn dense ({dense.mid:.2f} s, up to {dense.high:.2f}) and maybe slower than "
            f"sparse ({sparse:.2f} s)" if dense.supported else
            f"would make the next turn dense over {boundary} tokens, beyond what was measured"
        )
        return Decision(Verdict.HOLD, f"a {boundary}-token prefix {why}; holding until {full_boundary}{later_why}",
                        dense.mid, sparse)
    if dense.mid <= margin * beat and commits(margin):
        return Decision(
            Verdict.PUBLISH, f"full prefix: dense append expected {dense.mid:.2f} s{host and ' (' + host[2:] + ')'} "
            f"< sparse rerun {beat:.2f} s",
            dense.mid, beat,
        )
    if (host_measured and dense.supported and later is not None and dense.mid <= beat
            and dense.high <= beat / margin and commits(margin)):
        # The margin guards a bet on one turn. A publication bets the next turn and wins
        # every later one: where the host's factor is measured, the later turns pay by the
        # margin, and the next one is expected no slower (at most ~1.1x at the estimate's
        # high end), the conversation gains. Held "not yet clear" instead, a job pauses
        # (settled): bench server, 3072x2, three conversations, once a host turn moved the
        # factor to 1.08 both jobs still running paused (next turn 6.02 s against sparse
        # 6.54 s, their later turns paying by the margin), the next 30 s of idle time went
        # unused, neither conversation was published again, committed / run 0.39.
        return Decision(
            Verdict.PUBLISH,
            f"full prefix: the next turn's dense append {dense.mid:.2f} s (at most {dense.high:.2f}{host}) is no "
            f"slower than sparse {beat:.2f} s, and its later turns pay: the turn after next "
            f"{later.dense_s * host_factor:.2f} s against sparse {later.sparse_s:.2f} s",
            dense.mid, beat,
        )
    probe_pays = (dense.mid <= PROBE_BAR_AT_ARRIVAL * beat if length_known
                  else dense.mid <= beat and slices is not None and slices.high <= margin * beat)
    # A probe bets one turn within a few per cent, so only on a sparse cost whose error is
    # known to be small. bench policy's nine cells loaded during the first turn (six
    # shapes, 10,240 to 12,288 tokens): the cheapest rerun carried down to the quiet
    # machine read 0.91-1.22x the sparse reruns timed around the turn, and the four whose
    # verdict at arrival would have probed paid 1.24, 1.31, 0.96 and 1.01 (turns
    # 0.76-1.04x of the sparse route's); 3584x3 was held at the prior for 2.33 s of one
    # turn. Carried up to a loaded machine the same reading was 0.53-1.90x: no probe on
    # that. Five cells since, with the probe allowed so: three probes, next turns at most
    # 0.96x the reruns around them.
    timed_for_probe = measured_here or (carried_down and length_known)
    # The turns a probe commits must pay by the margin at the slices' own cost: at the
    # prior they are what the probe is there to find out (bench policy, 3584x3: held at
    # the prior, the host's dense append was 0.76 of the rerun, its later turns' 1.21x
    # longer appends pay too), and the factor it measures then holds back the others.
    # By the margin, not merely not losing: then at the prior itself (1.2 x 0.9) they
    # are at most 1.08x the rerun. Merely not losing, a probe on 1024x4 (attention-bound;
    # bench server, interleaved, --equal-idle) went out on later turns at 0.96 of the
    # rerun at the slices' cost, the host's factor read 1.19, and the conversation's
    # later turns took 1.12x, 1.13x and 1.22x sparse on's: a bet of 4 % against 15 %.
    probe_commits = commits(margin, 1.0)
    if may_probe and timed_for_probe and dense.supported and slices is not None and probe_pays and probe_commits:
        return Decision(
            Verdict.PUBLISH,
            f"full prefix, published to measure the host's dense append: {slices.mid:.2f} s at the slices' cost "
            f"(at most {slices.high:.2f}), {dense.mid:.2f} s at the prior ({host_factor:.2f}x), against sparse "
            f"{beat:.2f} s",
            dense.mid, beat, probes=True,
        )
    # Held by the prior alone (at the slices' own estimate the whole prefix publishes): what
    # decides it is the host's first dense turn (a probe, any conversation's), not more
    # slices, so the job runs on and is whole when that comes. Paused instead, three such
    # jobs left 44 s of idle time unused until a probe went out (bench server, 3072x2,
    # three conversations), and none was whole when the factor read 0.94.
    # The turns it would commit too: where they are not slower than sparse at the slices'
    # cost, a measured factor (another conversation's probe) may still publish, and a job
    # paused here would never be whole at a return to be published. Running on costs idle
    # time only; a probe is bet on a turn, and needs them to pay by the margin.
    prior_only = (not host_measured and slices is not None and slices.mid <= margin * beat
                  and commits(1.0, 1.0))
    return Decision(
        Verdict.HOLD,
        f"full prefix: dense append {dense.mid:.2f} s (from {dense.low:.2f}) against sparse {beat:.2f} s "
        f"(latest {sparse:.2f} s) is not yet clear either way; held for "
        + ("the host's first dense turn (its cost is the prior's)" if prior_only else "more evidence")
        + later_why,
        dense.mid,
        sparse,
        settled=dense.supported and not prior_only,
    )
