"""The publish policy's arithmetic: a dense cost fitted to slices, the sparse rerun it is
compared with, and the verdict for each situation a conversation can be in."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_recovery_plugin.events import RequestPrefilled, Route
from mlx_recovery_plugin.recovery.costs import (
    DEFAULT_APPEND_TOKENS,
    HOST_APPEND_PRIOR,
    PAYS_MARGIN,
    PROBE_BAR_AT_ARRIVAL,
    DenseCostModel,
    HostAppendFactor,
    SparseSample,
    Verdict,
    decide,
    later_turn,
    sparse_rerun_seconds,
)
from mlx_recovery_plugin.recovery.judge import PublishJudge
from mlx_recovery_plugin.settings import PublishPolicy


def fitted(a: float, b: float, contexts: tuple[int, ...] = (0, 512, 1024, 1536)) -> DenseCostModel:
    model = DenseCostModel()
    for c in contexts:
        model.observe(c, 512, a * 512 + b * (512 * c + 512 * 512 / 2))
    return model


def test_the_fit_recovers_matmul_and_attention_terms() -> None:
    model = fitted(2e-3, 1e-6)
    a, b = model.coefficients()
    assert a == pytest.approx(2e-3, rel=1e-6)
    assert b == pytest.approx(1e-6, rel=1e-6)
    assert model.seconds(600, 9000) == pytest.approx(2e-3 * 600 + 1e-6 * (600 * 9000 + 600 * 300))


def test_no_answer_until_three_slices_at_three_contexts() -> None:
    model = DenseCostModel()
    model.observe(0, 256, 1.0)
    model.observe(0, 256, 1.0)
    model.observe(256, 256, 1.2)
    assert not model.fitted and model.seconds(100, 100) is None
    model.observe(512, 256, 1.4)
    assert model.fitted


def test_noisy_samples_never_give_a_negative_cost() -> None:
    model = DenseCostModel()
    for c, t in ((0, 2.0), (256, 1.0), (512, 0.9), (768, 0.8)):  # cost falling with context
        model.observe(c, 256, t)
    a, b = model.coefficients()
    assert a >= 0 and b >= 0
    assert model.seconds(256, 4096) > 0


def test_bad_samples_are_ignored() -> None:
    model = DenseCostModel()
    for sample in ((0, 0, 1.0), (0, 10, 0.0), (0, 10, float("nan")), (-1, 10, 1.0)):
        model.observe(*sample)
    assert model.samples == 0


def test_sparse_rerun_scales_the_hosts_measurement_by_the_targets_share() -> None:
    model = fitted(1e-3, 0.0)
    measured = SparseSample(tokens=10_000, seconds=4.0)
    assert sparse_rerun_seconds(model, 10_000, 0.2, measured) == pytest.approx(4.0)
    assert sparse_rerun_seconds(model, 12_000, 0.2, measured) == pytest.approx(4.8, rel=1e-3)
    # Without a measurement: the kept tokens' dense prefill only (the draft is not counted).
    assert sparse_rerun_seconds(model, 10_000, 0.2, None) == pytest.approx(2.0)
    assert sparse_rerun_seconds(DenseCostModel(), 12_000, 0.2, measured) == pytest.approx(4.8)


MATMUL_BOUND = dict(a=2e-3, b=2e-8)  # a token at 10k costs 1.1x one at 0
ATTENTION_BOUND = dict(a=1e-3, b=1.2e-6)  # ... 13x


def verdict(model: DenseCostModel, boundary: int, *, full: int = 9216, threshold: int | None = 8192,
            next_tokens: int = 9800, sparse_s: float = 5.0) -> Verdict:
    return decide(
        model, boundary=boundary, full_boundary=full, next_tokens=next_tokens, threshold=threshold,
        keep=0.2, measured=SparseSample(9200, sparse_s),
    ).verdict


def test_a_partial_prefix_under_a_turn_that_stays_sparse_is_held_back() -> None:
    """bench policy on oMLX: 256 published tokens under a turn that stayed sparse made it
    4.4x slower than sparse on's (the draft's cached reading is keyed by the uncached part,
    so it missed); the prefix itself saved only the kept share of 256 tokens."""
    model = fitted(**ATTENTION_BOUND)
    assert verdict(model, 512) is Verdict.HOLD  # 9,288 uncached > 8,192: still sparse
    # The whole prefix under a turn whose new part alone crosses the threshold: published.
    assert verdict(model, 9216, next_tokens=9216 + 8300) is Verdict.PUBLISH


def test_no_stand_down_on_a_sparse_cost_carried_over_from_another_load_regime() -> None:
    model = fitted(**ATTENTION_BOUND, contexts=(0, 2048, 4096, 6144, 8192, 8704))
    args = dict(boundary=9216, full_boundary=9216, next_tokens=9800, threshold=8192, keep=0.2,
                measured=SparseSample(9200, 4.0))
    assert decide(model, **args).verdict is Verdict.STAND_DOWN  # type: ignore[arg-type]
    carried = decide(model, **args, measured_here=False)  # type: ignore[arg-type]
    assert carried.verdict is Verdict.HOLD and "not been timed" in carried.reason


def test_matmul_bound_model_publishes_a_prefix_that_makes_the_next_turn_dense() -> None:
    model = fitted(**MATMUL_BOUND)
    assert verdict(model, 9216) is Verdict.PUBLISH


def test_a_partial_prefix_that_would_make_the_next_turn_slower_is_held_back() -> None:
    """The case measured on the real server: 2,278 uncached tokens prefilled densely over
    7k took 11.7 s against 3.8 s sparse."""
    model = fitted(**MATMUL_BOUND)
    assert verdict(model, 2048, sparse_s=5.0) is Verdict.HOLD
    assert verdict(model, 9216, sparse_s=5.0) is Verdict.PUBLISH


def test_attention_bound_model_stands_down_and_says_why_once_measured_near_the_next_turn() -> None:
    model = fitted(**ATTENTION_BOUND, contexts=(0, 2048, 4096, 6144, 8192, 8704))
    decision = decide(
        model, boundary=9216, full_boundary=9216, next_tokens=9800, threshold=8192, keep=0.2,
        measured=SparseSample(9200, 4.0),
    )
    assert decision.verdict is Verdict.STAND_DOWN
    assert "costs more than a sparse rerun" in decision.reason
    assert decision.dense_s > decision.sparse_s


def test_a_whole_prefix_slower_by_less_than_the_margin_is_held_not_stood_down() -> None:
    """A stand-down drops what the job holds; a whole prefix whose cheapest reading is
    slower than the sparse rerun by less than the margin a publication must clear the
    other way (0.9) is held instead (settled: more slices would not change it), so that
    its conversation's next turn, judged at its real length, may still use it."""
    model = fitted(**ATTENTION_BOUND, contexts=(0, 2048, 4096, 6144, 8192, 8704))
    full = model.estimate(9800 - 9216, 9216)
    assert full is not None and full.supported

    def at(sparse_s: float):  # the rerun measured at the next turn's own length
        return decide(model, boundary=9216, full_boundary=9216, next_tokens=9800, threshold=8192, keep=0.2,
                      measured=SparseSample(9800, sparse_s))

    close = at(full.low / 1.05)
    assert close.verdict is Verdict.HOLD and close.settled and "too close to stand down" in close.reason
    assert at(full.low / 1.2).verdict is Verdict.STAND_DOWN


def test_evidence_from_short_contexts_alone_never_stands_a_job_down() -> None:
    """Issue 18's run B: a fit on contexts up to ~3.5k, extrapolated 3-4x, stood a job down
    for good. Beyond the evidence only a lower bound is known: the job is held, and goes on
    to where its own slices measure the cost."""
    model = fitted(**ATTENTION_BOUND)  # contexts up to 1.5k
    full = decide(
        model, boundary=9216, full_boundary=9216, next_tokens=9800, threshold=8192, keep=0.2,
        measured=SparseSample(9200, 4.0),
    )
    assert full.verdict is Verdict.HOLD and "not yet clear" in full.reason
    assert verdict(model, 2048, sparse_s=4.0) is Verdict.HOLD
    estimate = model.estimate(584, 9216)
    assert estimate is not None and not estimate.supported and estimate.high == float("inf")
    assert 0 < estimate.low < estimate.mid


def test_attention_timed_deep_raises_the_bound_beyond_the_evidence_and_settles_a_stand_down() -> None:
    """The same shallow evidence as above: the bound beyond it holds the job "not yet
    clear". Attention timed at the next turn's depth (the model's own per-token cost
    there) raises the bound with the context, and the stand-down is taken."""
    model = fitted(**ATTENTION_BOUND)  # contexts up to 1.5k
    args = dict(boundary=9216, full_boundary=9216, next_tokens=9800, threshold=8192, keep=0.2,
                measured=SparseSample(9200, 4.0))
    before = model.estimate(584, 9216)
    assert before is not None
    assert model.wants_attention(584, 9216)
    model.observe_attention(4096, ATTENTION_BOUND["b"] * 4096)  # too shallow to speak for 9.5k
    assert model.wants_attention(584, 9216) and model.estimate(584, 9216) == before
    evidence = model.evidence
    model.observe_attention(9800, ATTENTION_BOUND["b"] * 9800)
    assert model.evidence > evidence and not model.wants_attention(584, 9216)
    after = model.estimate(584, 9216)
    assert after is not None and not after.supported and after.high == float("inf")
    assert after.low > 2 * before.low
    assert after.low <= model.seconds(584, 9216) and after.mid >= after.low
    decision = decide(model, **args)  # type: ignore[arg-type]
    assert decision.verdict is Verdict.STAND_DOWN and "costs more than a sparse rerun" in decision.reason


def test_attention_timed_on_a_matmul_bound_model_leaves_its_publication_alone() -> None:
    model = fitted(**MATMUL_BOUND)
    before = verdict(model, 9216)
    model.observe_attention(9800, MATMUL_BOUND["b"] * 9800)
    assert verdict(model, 9216) is before is Verdict.PUBLISH


def test_a_burst_of_load_cannot_outvote_a_quiet_sample_of_the_same_context() -> None:
    quiet = fitted(**MATMUL_BOUND)
    model = DenseCostModel()
    a, b = MATMUL_BOUND["a"], MATMUL_BOUND["b"]
    for c in (0, 512, 1024, 1536):
        seconds = a * 512 + b * (512 * c + 512 * 512 / 2)
        for _ in range(5):
            model.observe(c, 512, 3.0 * seconds)  # the machine was loaded for a while
        model.observe(c, 512, seconds)  # then one quiet slice
    assert model.seconds(600, 1800) == pytest.approx(quiet.seconds(600, 1800), rel=1e-6)
    evidence = model.evidence
    model.observe(1024, 512, 10.0)  # a slow sample changes nothing the model says
    assert model.evidence == evidence


def test_a_faster_sample_lower_in_the_top_band_keeps_what_was_measured_supported() -> None:
    """Support is how far the evidence reaches: a faster slice a little lower in the
    furthest band changes that band's rate, not how far the model has seen."""
    model = DenseCostModel()
    a, b = MATMUL_BOUND["a"], MATMUL_BOUND["b"]

    def seconds(c: int, n: int = 128) -> float:
        return a * n + b * (n * c + n * n / 2)

    for c in (0, 512, 1024, 1792):  # the furthest at attended position 1,856
        model.observe(c, 128, seconds(c))
    # 1.25x past 1,856 reaches 2,320: a 128-token append over 2,150 attends at 2,214.
    assert model.estimate(128, 2150).supported
    model.observe(1700, 128, 0.95 * seconds(1700))  # attended at 1,764: the same band, faster
    estimate = model.estimate(128, 2150)
    assert estimate.supported and estimate.high < float("inf")


def test_a_host_dense_append_near_the_next_turn_extends_the_evidence() -> None:
    from mlx_recovery_plugin.recovery.costs import Source

    model = fitted(**ATTENTION_BOUND)
    assert not model.estimate(584, 9216).supported
    a, b = ATTENTION_BOUND["a"], ATTENTION_BOUND["b"]
    evidence = model.evidence
    model.observe(9000, 700, a * 700 + b * (700 * 9000 + 700 * 350), Source.HOST)
    assert model.evidence > evidence and model.host_samples == 1
    estimate = model.estimate(584, 9216)
    assert estimate.supported and estimate.mid == pytest.approx(a * 584 + b * (584 * 9216 + 584 * 292), rel=0.02)


def test_while_learning_a_partial_prefix_is_held_and_a_full_one_published() -> None:
    learning = DenseCostModel()
    assert verdict(learning, 2048) is Verdict.HOLD
    assert verdict(learning, 9216) is Verdict.PUBLISH


def test_unknown_threshold_assumes_the_next_turn_is_dense_over_the_prefix() -> None:
    model = fitted(**ATTENTION_BOUND)
    assert verdict(model, 512, threshold=None) is not Verdict.PUBLISH


# -- the machine's load regime ------------------------------------------------------------


class Counters:
    """Injected CPU counters: ``advance`` moves the machine on by ``seconds`` of wall time
    with ``others`` of its 2 cores busy with other processes and ``own`` with this one,
    whose one thread waited ``wait`` seconds for a core per second it ran on one."""

    def __init__(self) -> None:
        self.busy = self.total = self.mine = self.waited = 0.0

    def __call__(self) -> tuple[float, float, float]:
        return self.busy, self.total, self.mine

    def threads(self) -> dict[int, tuple[float, float]]:
        return {1: (self.mine, self.waited)}

    def advance(self, seconds: float, others: float, own: float = 1.0, wait: float = 0.0) -> None:
        self.busy += (others + own) * seconds
        self.mine += own * seconds
        self.waited += wait * own * seconds
        self.total += 2 * seconds


def test_the_load_regime_is_the_share_other_processes_took_since_the_last_look() -> None:
    from mlx_recovery_plugin.recovery.machine_load import MachineLoad, Regime

    counters = Counters()
    load = MachineLoad(counters)
    counters.advance(2.0, others=0.1)
    assert load.look() is Regime.QUIET
    counters.advance(2.0, others=1.0)  # one of the two cores: half the machine
    assert load.look() is Regime.BUSY and load.last_share == pytest.approx(0.5)
    counters.advance(0.05, others=0.0)  # too short to tell: the window stays open
    assert load.look() is None
    counters.advance(2.0, others=0.0)
    assert load.look() is Regime.QUIET
    assert MachineLoad(lambda: None).look() is None


def test_the_loads_demand_and_contention_are_read_beside_the_others_share() -> None:
    """Others who would saturate both cores show half the machine over a window in which
    this process competed (they got what it left): the fair share of that says its passes
    take 1.5x. Their demand is what they took of what it left (all of it: 2x), and its
    threads waited as long as they ran (2x). Where the threads hardly ran, the others'
    share is their demand, and stands in for the contention."""
    import dataclasses

    from mlx_recovery_plugin.recovery.machine_load import LoadReading, MachineLoad, Regime

    counters = Counters()
    load = MachineLoad(counters, counters.threads)
    assert load.reading is None  # nothing judged yet
    counters.advance(2.0, others=1.0, own=1.0, wait=1.0)
    assert load.look() is Regime.BUSY
    assert load.reading == LoadReading(0.5, 1.0, 2.0)
    counters.advance(2.0, others=1.0, own=1.0, wait=0.5)  # the same regime: both windows count
    assert load.look() is Regime.BUSY and load.reading == LoadReading(0.5, 1.0, 1.75)
    counters.advance(2.0, others=0.04, own=1.9, wait=0.01)  # quiet: counted afresh
    assert load.look() is Regime.QUIET
    # Its daemons took 2 % where this process took most of the machine: not a demand of 40 %.
    assert dataclasses.astuple(load.reading) == pytest.approx((0.02, 0.02, 1.01))
    counters.advance(10.0, others=1.8, own=0.002, wait=5.0)  # busy while this process slept
    assert load.look() is Regime.BUSY
    reading = load.reading
    assert reading is not None and reading.demand == pytest.approx(18 / (20 - 0.02))
    assert reading.contention == pytest.approx(1 + reading.demand)
    # Without the threads' statistics (not Linux), the demand stands in.
    counters = Counters()
    load = MachineLoad(counters, lambda: None)
    counters.advance(2.0, others=1.0, own=1.0, wait=1.0)
    assert load.look() is Regime.BUSY and load.reading == LoadReading(0.5, 1.0, 2.0)


def test_a_thread_born_in_a_window_counts_from_the_next_one() -> None:
    from mlx_recovery_plugin.recovery.machine_load import MachineLoad

    counters = Counters()
    threads: dict[int, tuple[float, float]] = {1: (0.0, 0.0)}
    load = MachineLoad(counters, lambda: dict(threads))
    counters.advance(2.0, others=1.0)
    threads.update({1: (1.0, 1.0), 2: (50.0, 0.0)})  # 2's counts are from before the window
    load.look()
    assert load.reading is not None and load.reading.contention == pytest.approx(2.0)
    counters.advance(2.0, others=1.0)
    threads.update({1: (2.0, 2.0), 2: (52.0, 0.0)})
    load.look()
    assert load.reading.contention == pytest.approx((2.0 + 2.0 + 2.0) / 4.0)


def _judge_with(counters: Counters, threads: bool = False) -> Any:
    """A judge reading ``counters``; with ``threads``, its threads' waits too (else, as
    the suite hides them, not known)."""
    from mlx_recovery_plugin.recovery.judge import PublishJudge
    from mlx_recovery_plugin.recovery.machine_load import MachineLoad
    from mlx_recovery_plugin.settings import PublishPolicy

    return PublishJudge(PublishPolicy.AUTO, 256, load=MachineLoad(counters, counters.threads if threads else None))


def _sparse_turn(tokens: int, seconds: float, request_id: str = "r") -> Any:
    from mlx_recovery_plugin.events import SparseRouteServed

    return SparseRouteServed("e", request_id, "m", tuple(range(tokens)), 0, tokens, threshold=8192, keep=0.2,
                             prefill_s=seconds)


def test_slices_timed_on_a_loaded_machine_do_not_stand_down_a_quiet_one() -> None:
    """A build keeps both cores busy while the first turn is served and the first slices run
    (all twice as slow); then the machine is quiet. The loaded evidence, against a sparse
    turn also timed under load, must not decide the quiet machine's next turn: there the
    policy waits for quiet slices, and with them publishes."""
    from mlx_recovery_plugin.recovery.costs import Verdict
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8704)), 8704)
    counters.advance(10.0, others=1.0)
    judge.note_route(job, _sparse_turn(8704, 10.0), appended=600, now=0.0)
    # Loaded slices: 4 ms a token plus attention, twice the quiet machine's cost.
    for context in (0, 1024, 2048):
        counters.advance(5.0, others=1.0)
        judge.observe(context, 1024, 2 * 1024 * (2e-3 + 1e-7 * (context + 512)))
    assert judge.regime.value == "busy"
    loaded = judge.judge(job, 8704)
    counters.advance(5.0, others=0.0)  # the build ends
    judge.observe(3072, 1024, 1024 * (2e-3 + 1e-7 * 3584))
    assert judge.regime.value == "quiet"
    # One quiet slice: the quiet model is not fitted, and the loaded one does not answer.
    assert judge.judge(job, 8704).reason == "full prefix; dense cost not yet learned"
    for context in (4096, 5120):
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (2e-3 + 1e-7 * (context + 512)))
    quiet = judge.judge(job, 8704)
    assert quiet.verdict is Verdict.PUBLISH, quiet.reason
    # The sparse turn was timed under load: in the quiet regime it counts at the quiet
    # machine's speed, not as measured: other processes took the core this one left them,
    # a demand of the whole machine, which halves it.
    assert quiet.sparse_s == pytest.approx(loaded.sparse_s / 2, rel=0.05)
    assert judge.status()["regime_switches"] == 2


def test_a_sparse_turn_timed_under_load_does_not_make_a_quiet_machine_publish_where_it_loses() -> None:
    """Attention-bound: on the quiet machine the next turn's dense append costs more than
    its sparse rerun. The first turn ran on a loaded machine (its sparse prefill took
    twice as long); taken at face value it would make the dense append look cheap."""
    from mlx_recovery_plugin.recovery.costs import Verdict
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8704)), 8704)
    counters.advance(10.0, others=1.0)
    judge.note_route(job, _sparse_turn(8704, 3.0), appended=600, now=0.0)  # 1.5 s quiet
    for context in (0, 2048, 4096, 6144, 7680):
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (1e-4 + 4e-7 * (context + 512)))
    decision = judge.judge(job, 8704)
    # Dense append of 600 over 8704: ~2.2 s; the sparse turn took 3 s while other processes
    # had half the machine, so about 1.5 s on the quiet one (taken as measured, 3 s would
    # make the dense append look a clear win).
    assert decision.verdict is not Verdict.PUBLISH, decision.reason


def test_a_full_prefix_is_published_only_if_it_beats_the_cheapest_recent_sparse_turn_too() -> None:
    """Attention-bound, as measured on the real server (512x8 target): the policy took the
    latest sparse turn (a slow one, 8.2 s) at face value and published a dense append it
    expected at 7.0 s; the turn took 7.4 s against sparse on's 6.5 s. An earlier sparse turn
    of the same conversation had cost 5.5 s: a dense append must beat that one too."""
    model = fitted(**ATTENTION_BOUND, contexts=(0, 2048, 4096, 6144, 8192, 8704))
    dense = model.estimate(9800 - 9216, 9216)
    assert dense is not None
    args: dict[str, Any] = dict(boundary=9216, full_boundary=9216, next_tokens=9800, threshold=8192, keep=0.2)
    slow = SparseSample(9200, dense.mid / 0.8)  # the latest: the dense append looks like a 20 % win
    cheap = SparseSample(9200, dense.mid * 0.95)  # an earlier one: the dense append loses
    assert decide(model, **args, measured=slow).verdict is Verdict.PUBLISH
    held = decide(model, **args, measured=slow, cheapest=cheap)
    assert held.verdict is Verdict.HOLD and "not yet clear" in held.reason, held.reason
    # A stand-down still weighs the latest turn: the cheap one alone does not stand it down.
    assert held.verdict is not Verdict.STAND_DOWN
    # Where the dense append wins by far, the cheapest turn changes nothing.
    matmul = fitted(**MATMUL_BOUND, contexts=(0, 2048, 4096, 6144, 8192, 8704))
    assert decide(matmul, **args, measured=SparseSample(9200, 5.0), cheapest=SparseSample(9200, 4.0)).verdict \
        is Verdict.PUBLISH


def test_after_the_load_changes_an_arrivals_wait_is_bounded_by_the_other_regimes_cost() -> None:
    """The grain of a slice's passes bounds how long an arriving request waits: after a
    build ends, the quiet model is not fitted for a few slices, and the loaded one (the
    slower) answers for the layers' time instead of nothing."""
    counters = Counters()
    judge = _judge_with(counters)
    for context in (0, 1024, 2048):
        counters.advance(5.0, others=1.0)
        judge.observe(context, 1024, 2 * 1024 * (2e-3 + 1e-7 * (context + 512)))
    assert judge.regime.value == "busy"
    loaded = judge.costs.seconds(256, 9000)
    assert loaded is not None and judge.layer_seconds_bound(256, 9000) == pytest.approx(loaded)
    counters.advance(5.0, others=0.0)  # the build ends
    judge.observe(3072, 1024, 1024 * (2e-3 + 1e-7 * 3584))
    assert judge.regime.value == "quiet" and judge.costs.seconds(256, 9000) is None
    assert judge.layer_seconds_bound(256, 9000) == pytest.approx(loaded)
    for context in (4096, 5120):
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (2e-3 + 1e-7 * (context + 512)))
    quiet = judge.costs.seconds(256, 9000)
    assert quiet is not None and quiet < loaded
    assert judge.layer_seconds_bound(256, 9000) == pytest.approx(quiet), "the regime's own, once it has one"


def test_the_judge_remembers_a_few_recent_sparse_turns_and_weighs_the_cheapest() -> None:
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob
    from mlx_recovery_plugin.recovery.judge import RECENT_SPARSE
    from mlx_recovery_plugin.recovery.machine_load import Regime

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8704)), 8704)
    for turn, seconds in enumerate((2.0, 6.0, 7.0, 8.0)):  # the cheap one falls out of the window
        counters.advance(5.0, others=0.0)
        judge.note_route(job, _sparse_turn(8704, seconds, f"r{turn}"), appended=600, now=0.0)
    route = judge._routes[job.job_id]
    assert [s.seconds for s in route.recent[Regime.QUIET]] == [6.0, 7.0, 8.0][-RECENT_SPARSE:]
    assert route.cheapest(Regime.QUIET, 600).seconds == 6.0 and route.sparse[Regime.QUIET].seconds == 8.0
    assert route.cheapest(Regime.BUSY, 600) is None
    # A route that became far slower (not noise: beyond NOISE_SPAN) is weighed by its latest turn.
    counters.advance(5.0, others=0.0)
    judge.note_route(job, _sparse_turn(8704, 60.0, "r4"), appended=600, now=0.0)
    assert route.cheapest(Regime.QUIET, 600).seconds == 60.0


def test_a_first_turn_counts_its_draft_reading_only_for_the_new_tokens_when_weighing_a_publication() -> None:
    """oMLX scores the whole first prompt with its draft at the door (3.2 s of a 12.5 s
    sparse turn, measured with a 2048x6 target) and keeps that reading: the conversation's
    next sparse turn re-scores only what was appended (0.6 s). Taken whole, the first turn
    overstates the rerun a publication has to beat."""
    from mlx_recovery_plugin.events import SparseRouteServed
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob
    from mlx_recovery_plugin.recovery.machine_load import Regime

    first = SparseSample(8594, 12.5, door_s=3.2)
    rerun = first.as_rerun(600)
    assert rerun.seconds == pytest.approx(12.5 - 3.2 + 3.2 * 600 / 8594)
    assert SparseSample(8594, 12.5).as_rerun(600).seconds == 12.5  # a host that says nothing: as measured
    assert SparseSample(100, 1.0, door_s=5.0).as_rerun(600).seconds == pytest.approx(1.0)  # never below 0 or above

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8594)), 8594)
    event = SparseRouteServed("e", "r", "m", tuple(range(8594)), 0, 8594, threshold=8192, keep=0.2,
                              prefill_s=12.5, door_s=3.2)
    judge.note_route(job, event, appended=600, now=0.0)
    route = judge._routes[job.job_id]
    assert route.sparse[Regime.QUIET].seconds == 12.5  # a stand-down still weighs the turn as it was
    assert route.cheapest(Regime.QUIET, 600).seconds == pytest.approx(rerun.seconds)


def _first_turn_loaded_then_quiet(prefill_s: float, door_s: float) -> tuple[Any, Any]:
    """A judge whose conversation's first sparse turn (8,704 tokens) took ``prefill_s``
    (``door_s`` of it at the door) while a build kept both cores busy, as did its first
    slices (twice the quiet cost); then the machine went quiet for five more."""
    from mlx_recovery_plugin.events import SparseRouteServed
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8704)), 8704)
    counters.advance(10.0, others=1.0)
    judge.note_route(job, SparseRouteServed("e", "r", "m", tuple(range(8704)), 0, 8704, threshold=8192, keep=0.2,
                                            prefill_s=prefill_s, door_s=door_s), appended=None, now=0.0)
    for context in (0, 1024, 2048):
        counters.advance(5.0, others=1.0)
        judge.observe(context, 1024, 2 * 1024 * (2e-3 + 1e-7 * (context + 512)))
    for context in (3072, 4096, 5120, 6144, 7168):
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (2e-3 + 1e-7 * (context + 512)))
    return judge, job


def test_a_first_turn_carried_over_from_a_loaded_machine_counts_its_draft_reading_as_a_rerun_would() -> None:
    """The first turn ran loaded: 8 s, 5.2 s of it the draft scoring the whole prompt at
    the door. Carried over to the quiet machine (a half: the others took the core this
    process left them, a demand of the whole machine) it is 4 s, which a dense append of
    ~2.1 s (600 tokens over 8,704 at the host's prior factor) beats; but the rerun it
    implies re-scores only the 600 new tokens at the door (~1.7 s in all), which that
    dense append does not beat. A
    sparse turn measured in the current regime is weighed as a rerun; one carried over
    from the other regime must be too."""
    fair = 1 / 2  # other processes wanted the whole machine
    judge, job = _first_turn_loaded_then_quiet(8.0, 5.2)
    assert judge.regime.value == "quiet"
    decision = judge.judge(job, 8704, next_tokens=8704 + 600)
    dense = HOST_APPEND_PRIOR * 600 * (2e-3 + 1e-7 * (8704 + 300))
    rerun = fair * (8.0 - 5.2 + 5.2 * 600 / 8704) * 1.07  # ~7 % more kept tokens next turn
    assert 0.9 * rerun < dense < 0.9 * fair * 8.0  # what the test is about
    assert decision.verdict is Verdict.HOLD, decision.reason  # not published, not stood down
    carried = judge.status()["sparse_carried_over"]
    assert (carried["from"], carried["door_s"]) == ("busy", 5.2)
    # The quiet slices (from 3,072 on) never attended where the kept pass does: the dense
    # costs are not compared there, and the others' demand carries the turn.
    assert carried["by_dense_costs"] is None
    assert carried["factor"] == pytest.approx(fair, rel=0.01) == carried["by_demand"]
    # A slower first turn, whose rerun the dense append does beat, is published.
    judge, job = _first_turn_loaded_then_quiet(16.0, 5.2)
    decision = judge.judge(job, 8704, next_tokens=8704 + 600)
    assert decision.verdict is Verdict.PUBLISH, decision.reason
    # Weighed against the rerun, grown to the next prompt's length, not against the whole
    # first turn (8 s carried over).
    assert decision.sparse_s == pytest.approx(fair * (16.0 - 5.2 + 5.2 * 600 / 8704) * 1.07, rel=0.03)


def _whole_prefix_600_tokens_on(host_factor: float) -> tuple[DenseCostModel, float, dict[str, Any]]:
    """Slices at 2 ms a token at any context (measured to 9,216), the next turn 600 tokens
    over a whole 9,216-token prefix, and ``decide``'s arguments for it at ``host_factor``;
    returns the model, the slices' cost of that append, and the arguments."""
    model = fitted(2e-3, 0.0, contexts=(0, 3072, 6144, 9216))
    dense = model.seconds(600, 9216)
    assert dense is not None
    return model, dense, dict(boundary=9216, full_boundary=9216, next_tokens=9816, threshold=8192, keep=1.0,
                              host_factor=host_factor)


def test_at_arrival_a_probe_on_a_sparse_cost_carried_down_still_needs_later_turns_paying_by_the_margin() -> None:
    """``bench policy``, 3584x3 at 10,240, loaded during the first turn: at the arrival the
    whole prefix's dense append at the host's prior (1.2x the slices') read 0.905 of the
    rerun carried down to the quiet machine, just short of the margin, and it was held, 2.33 s
    of one turn lost, where the sparse rerun took 1.31x the host's dense append. A sparse
    cost carried down to a quiet machine read 0.91-1.22x the truth: for the next turn at
    arrival the probe bets on it. But the turns it commits read 0.95 of their rerun at the
    slices' cost, which on 1024x4 (bench server) a host at 1.19x turned into later turns at
    1.12-1.22x sparse on's: held, running on for the host's first dense turn."""
    from mlx_recovery_plugin.recovery import judge as judge_module
    from mlx_recovery_plugin.recovery.machine_load import Regime

    with pytest.MonkeyPatch.context() as patch:  # the next turn alone: a probe
        patch.setattr(judge_module, "later_turn", lambda *args, **kwargs: None)
        judge, job = _first_turn_loaded_then_quiet(8.8, 5.2)
        alone = judge.judge(job, 8704, next_tokens=8704 + 600)
        assert alone.verdict is Verdict.PUBLISH and alone.probes, alone.reason
        # What the next turn's bet is: at the prior a few per cent either side of the carried rerun.
        assert alone.dense_s is not None and alone.sparse_s is not None
        assert 0.9 < alone.dense_s / alone.sparse_s <= PROBE_BAR_AT_ARRIVAL
    judge, job = _first_turn_loaded_then_quiet(8.8, 5.2)
    assert judge.regime is Regime.QUIET and not judge.status()["host_append_measured"]
    decision = judge.judge(job, 8704, next_tokens=8704 + 600)
    assert judge.status()["sparse_carried_over"]["from"] == "busy"
    assert decision.later is not None
    assert PAYS_MARGIN < decision.later.dense_s / decision.later.sparse_s <= 1.0
    assert decision.verdict is Verdict.HOLD and not decision.probes and not decision.settled, decision.reason
    assert "the host's first dense turn" in decision.reason


def test_a_probe_at_arrival_needs_a_sparse_cost_timed_here_or_carried_down() -> None:
    model, dense, kw = _whole_prefix_600_tokens_on(host_factor=1.2)
    kw |= dict(measured=SparseSample(9816, 1.2 * dense), may_probe=True)
    assert decide(model, **kw, length_known=True).probes  # timed in this regime
    carried_up = decide(model, **kw, length_known=True, measured_here=False)
    assert carried_up.verdict is Verdict.HOLD and not carried_up.probes, carried_up.reason
    carried_down = decide(model, **kw, length_known=True, measured_here=False, carried_down=True)
    assert carried_down.verdict is Verdict.PUBLISH and carried_down.probes, carried_down.reason
    idle = decide(model, **kw, measured_here=False, carried_down=True)  # the length not known
    assert idle.verdict is Verdict.HOLD and not idle.probes, idle.reason


def test_a_whole_prefix_held_only_by_the_host_prior_is_not_settled() -> None:
    """At the slices' own estimate the whole prefix pays by the margin, at the prior (1.2x)
    it is too close to call: the host's first dense turn decides, and until it is measured
    the hold is not one that more slices would leave unchanged. With the factor measured,
    or where the slices alone do not pay by the margin, it is."""
    model, dense, kw = _whole_prefix_600_tokens_on(host_factor=1.2)
    close = SparseSample(9816, dense / 0.85)  # the slices pay by 0.85, the prior reads 1.02
    prior = decide(model, **kw, measured=close, host_measured=False)
    assert prior.verdict is Verdict.HOLD and not prior.settled, prior.reason
    assert "host's first dense turn" in prior.reason
    measured = decide(model, **kw, measured=close)
    assert measured.verdict is Verdict.HOLD and measured.settled, measured.reason
    closer = decide(model, **kw, measured=SparseSample(9816, dense / 0.95), host_measured=False)
    assert closer.verdict is Verdict.HOLD and closer.settled, closer.reason


def test_a_turn_sent_as_a_load_ends_is_timed_in_the_regime_it_ran_in() -> None:
    """A build kept one core of two busy through the first gap and ended as the next turn
    was sent. The turn ran on a quiet machine: its sparse time is the quiet regime's, not
    the busy one's (read together with the gap it was, and carried back to the quiet
    machine at the fair share it read ~0.65x what the host's sparse turns took)."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob
    from mlx_recovery_plugin.recovery.machine_load import Regime

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(9499)), 8704)
    counters.advance(30.0, others=1.0, own=0.0)  # the gap: a build on one core, nothing here
    judge.note_lookup()  # the next turn arrives
    counters.advance(3.4, others=0.0, own=2.0)  # and runs on both cores, alone
    judge.note_route(job, _sparse_turn(9499, 3.4), appended=600, now=0.0)
    route = judge._routes[job.job_id]
    assert list(route.sparse) == [Regime.QUIET]
    assert route.sparse[Regime.QUIET].load.share == pytest.approx(0.0)
    assert judge.status()["load_regime"] == "quiet"


def test_the_status_shows_the_carry_behind_the_last_verdict_not_another_conversations() -> None:
    """Ordering the work weighs every conversation's expected saving, each carrying its own
    sparse turn across the regimes; the status's ``sparse_carried_over`` must still say
    what the last verdict was taken on (it showed the last conversation weighed)."""
    from mlx_recovery_plugin.events import SparseRouteServed
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    first = RecoveryJob(1, tuple(range(8704)), 8704)
    other = RecoveryJob(2, tuple(range(100_000, 106_000)), 6000)
    counters.advance(10.0, others=1.0)
    for job, prefill_s, door_s in ((first, 8.0, 5.2), (other, 12.0, 3.0)):
        judge.note_route(job, SparseRouteServed("e", f"r{job.job_id}", "m", job.tokens, 0, len(job.tokens),
                                                threshold=8192, keep=0.2, prefill_s=prefill_s, door_s=door_s),
                         appended=None, now=0.0)
    for busy, slowdown in ((1.0, 2.0), (0.0, 1.0)):
        for context in (0, 1024, 2048):
            counters.advance(5.0, others=busy)
            judge.observe(context, 1024, slowdown * 1024 * (2e-3 + 1e-7 * (context + 512)))
    assert judge.regime.value == "quiet"
    judge.judge(first, 8704, next_tokens=8704 + 600)
    assert (judge.status()["sparse_carried_over"]["seconds"], judge.status()["sparse_carried_over"]["tokens"]) == (
        8.0, 8704)
    assert judge.expected_saving(other, now=0.0) > 0  # weighed on its own carried-over turn
    counters.advance(5.0, others=0.0)
    judge.observe(3072, 1024, 1024 * (2e-3 + 1e-7 * (3072 + 512)))  # the status is built again
    assert judge.status()["sparse_carried_over"]["seconds"] == 8.0  # still the verdict's


def test_the_regimes_dense_costs_are_compared_only_where_both_have_evidence() -> None:
    """Slices at the same contexts in both regimes (another conversation's, say) compare
    the regimes where the kept pass attends: here the load slowed them by 1.25x, milder
    than the others' demand's 2x, and that carries the turn."""
    from mlx_recovery_plugin.events import SparseRouteServed
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8704)), 8704)
    counters.advance(10.0, others=1.0)
    judge.note_route(job, SparseRouteServed("e", "r", "m", tuple(range(8704)), 0, 8704, threshold=8192, keep=0.2,
                                            prefill_s=8.0, door_s=4.0), appended=None, now=0.0)
    for busy, slowdown in ((1.0, 1.25), (0.0, 1.0)):
        for context in (0, 512, 1024, 2048):
            counters.advance(5.0, others=busy)
            judge.observe(context, 512, slowdown * 512 * (2e-3 + 1e-7 * (context + 256)))
    assert judge.regime.value == "quiet"
    judge.judge(job, 8704, next_tokens=8704 + 600)
    carried = judge.status()["sparse_carried_over"]
    assert carried["by_dense_costs"] == pytest.approx(0.8, rel=0.01)
    assert carried["by_demand"] == pytest.approx(1 / 2, abs=1e-4)
    assert carried["factor"] == carried["by_dense_costs"]


def _quiet_first_turn_with_threads(prefill_s: float) -> tuple[Counters, Any, Any]:
    """A judge that reads its threads' waits, whose conversation's first sparse turn (8,704
    tokens, 1 s at the door) took ``prefill_s`` on a quiet machine, as did four slices."""
    from mlx_recovery_plugin.events import SparseRouteServed
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters, threads=True)
    job = RecoveryJob(1, tuple(range(8704)), 8704)
    counters.advance(10.0, others=0.0, wait=0.01)
    judge.note_route(job, SparseRouteServed("e", "r", "m", job.tokens, 0, 8704, threshold=8192, keep=0.2,
                                            prefill_s=prefill_s, door_s=1.0), appended=None, now=0.0)
    for context in (0, 1024, 2048, 3072):
        counters.advance(5.0, others=0.0, wait=0.01)
        judge.observe(context, 1024, 1024 * (2e-3 + 1e-7 * (context + 512)))
    return counters, judge, job


def test_a_quiet_turn_is_carried_to_a_loaded_machine_by_what_the_others_wanted() -> None:
    """``bench policy``, 4096x2, loaded at the next turn: its quiet sparse turn carried to
    the busy machine at the fair share of the others' 0.5 (1.5x) held the whole prefix
    "not yet clear", where the loaded rerun took 2.2-3.5x the quiet one. The others took
    all this process left them (a demand of the whole machine: 2x), and its slices'
    threads waited as long as they ran (2x): carried at that, the dense append beats the
    rerun."""
    from mlx_recovery_plugin.recovery.costs import Verdict

    counters, judge, job = _quiet_first_turn_with_threads(3.5)
    for context in (4096, 5120, 6144, 7168):
        counters.advance(5.0, others=1.0, wait=1.0)
        judge.observe(context, 1024, 2 * 1024 * (2e-3 + 1e-7 * (context + 512)))
    counters.advance(1.0, others=1.0, wait=1.0)
    judge.note_lookup()  # the next turn arrives, 600 tokens on
    decision = judge.judge(job, 8704, next_tokens=8704 + 600)
    carried = judge.status()["sparse_carried_over"]
    assert decision.verdict is Verdict.PUBLISH, decision.reason
    assert carried["by_demand"] == pytest.approx(2.0) and carried["by_contention"] == pytest.approx(2.0 / 1.01)
    assert carried["factor"] == carried["by_contention"]  # the milder
    assert carried["load_then"]["share"] == 0.0 and carried["load_now"]["share"] == 0.5
    # At the fair share of the others' 0.5 the rerun would not have been beaten.
    fair_share_rerun = decision.sparse_s * 1.5 / carried["factor"]
    assert decision.dense_s > 0.9 * fair_share_rerun


def test_a_load_that_yields_to_this_process_carries_a_turn_at_its_contention() -> None:
    """A ``nice`` build takes half the machine but gives way to this process, whose threads
    hardly waited: the others' demand (2x) would overstate what the load does to its passes,
    and the contention (1.05x) carries the turn."""
    counters, judge, job = _quiet_first_turn_with_threads(6.0)
    counters.advance(5.0, others=1.0, wait=0.05)
    judge.note_lookup()
    judge.judge(job, 8704, next_tokens=8704 + 600)
    carried = judge.status()["sparse_carried_over"]
    assert carried["by_demand"] == pytest.approx(2.0)
    assert carried["factor"] == carried["by_contention"] == pytest.approx(1.05 / 1.01, rel=1e-3)


def test_a_turn_is_carried_across_load_regimes_by_the_mildest_estimate() -> None:
    """Each estimate of how the load changed a pass overstates somewhere: the dense costs of
    short slices under load (a 256-token pass 2.6x, a 2,048-token one 1.75x here, under two
    busy processes on 2 cores), the threads' waits of those slices (3.1-4.1x where the
    host's reruns took 2.4-3.3x), the demand on a GPU, which busy CPUs hardly slow."""
    from mlx_recovery_plugin.recovery.machine_load import (
        LoadReading,
        carry_factor,
        contention_factor,
        demand_factor,
    )

    quiet, busy = LoadReading(0.01, 0.01, 1.02), LoadReading(0.6, 1.0, 3.5)
    assert demand_factor(quiet, busy) == pytest.approx(2.0 / 1.01)
    assert demand_factor(busy, quiet) == pytest.approx(1.01 / 2.0)
    assert contention_factor(quiet, busy) == pytest.approx(3.5 / 1.02)
    assert contention_factor(busy, quiet) == pytest.approx(1.02 / 3.5)
    assert demand_factor(None, busy) is None and contention_factor(quiet, None) is None
    assert carry_factor(0.22, 0.5, 0.29) == 0.5  # CPU: the short slices overstate it
    assert carry_factor(1.0, 0.5, 0.29) == 1.0  # a GPU: the slices did not slow
    assert carry_factor(3.5, 2.0, 3.4) == 2.0  # the other way round
    assert carry_factor(None, 0.58, None) == 0.58 and carry_factor(0.5, None, None) == 0.5
    assert carry_factor(None, None, None) is None


def test_one_sparse_turn_told_by_both_hooks_is_one_recent_sample() -> None:
    """oMLX reports a later sparse turn twice: ``request_prefilled`` at its first token,
    then ``sparse_route_served`` (with the door's share) when it finishes. Counted twice,
    the recent turns would cover half as many turns as they say."""
    from mlx_recovery_plugin.events import RequestPrefilled, Route, SparseRouteServed
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob
    from mlx_recovery_plugin.recovery.machine_load import Regime

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(8594)), 8594)
    for turn, seconds in enumerate((12.0, 9.0, 10.0, 11.0)):
        counters.advance(5.0, others=0.0)
        tokens = tuple(range(8594 + 600 * turn))
        rid = f"r{turn}"
        if turn:
            judge.observe_turn(job, RequestPrefilled("e", rid, "m", tokens, 0, Route.SPARSE, seconds))
        judge.note_route(job, SparseRouteServed("e", rid, "m", tokens, 0, len(tokens), threshold=8192, keep=0.2,
                                                prefill_s=seconds, door_s=0.5), appended=600, now=0.0)
    recent = judge._routes[job.job_id].recent[Regime.QUIET]
    assert [(s.request_id, s.seconds, s.door_s) for s in recent] == [("r1", 9.0, 0.5), ("r2", 10.0, 0.5),
                                                                   ("r3", 11.0, 0.5)]


def test_the_host_append_factor_is_the_prior_until_the_host_runs_a_dense_turn_then_its_median() -> None:
    factor = HostAppendFactor()
    assert factor.value == HOST_APPEND_PRIOR and factor.measured == 0
    for predicted, actual in ((2.0, 2.2), (None, 9.0), (0.0, 1.0), (2.0, float("nan")), (2.0, -1.0)):
        factor.observe(predicted, actual)
    assert factor.measured == 1 and factor.value == pytest.approx(1.1)  # a host cheaper than the prior
    factor.observe(1.0, 1.5)
    factor.observe(4.0, 4.0)
    assert factor.value == pytest.approx(1.1)  # median of 1.0, 1.1, 1.5


def test_a_close_full_prefix_is_published_at_the_hosts_cost_not_the_slices() -> None:
    """The slices say the next turn's dense append costs 0.8 of the sparse rerun; the host
    runs it at 1.3x the slices' estimate (it restores the blocks first), so it would take
    1.04x the rerun: held, not published. The stand-down still reads the slices' cheaper
    estimate: a factor alone never stops recovery."""
    model = fitted(2e-3, 0.0)
    dense = model.seconds(600, 9216)
    sparse = SparseSample(9816, dense / 0.8)
    kw: dict[str, Any] = dict(boundary=9216, full_boundary=9216, next_tokens=9816, threshold=8192, keep=1.0,
                              measured=sparse)
    assert decide(model, **kw, host_factor=1.0).verdict is Verdict.PUBLISH
    held = decide(model, **kw, host_factor=1.3)
    assert held.verdict is Verdict.HOLD and "not yet clear" in held.reason
    assert held.dense_s == pytest.approx(1.3 * dense, rel=0.05)
    paying = decide(model, **(kw | {"measured": SparseSample(9816, dense * 2.0)}), host_factor=1.3)
    assert paying.verdict is Verdict.PUBLISH and "1.30x the slices'" in paying.reason
    losing = decide(model, **(kw | {"measured": SparseSample(9816, dense * 0.95)}), host_factor=1.3)
    assert losing.verdict is Verdict.HOLD, "slower only at the host's cost: held, not stood down"


def test_a_host_dense_turn_is_counted_once_in_what_the_next_such_turn_is_expected_to_cost() -> None:
    """Slices cost 10 ms a token at any context; the host's own append of 552 tokens over
    960 cached took 1.3x that. Its factor says so, and the sample goes into the slices'
    model as the pass it implies: the host's next such turn is expected at what the host
    took, not 1.3x on top of a model already pulled up to the host's time."""
    judge = PublishJudge(PublishPolicy.AUTO, 64)
    for context in range(0, 960, 128):
        judge.observe(context, 128, 128 * 0.01)
    host_s = 1.3 * 552 * 0.01
    judge.observe_turn(None, RequestPrefilled("e", "r", "m", tuple(range(1512)), 960, Route.DENSE, host_s))
    assert judge.status()["host_append_factor"] == pytest.approx(1.3, rel=0.01)
    expected = judge.costs.seconds(552, 960) * judge.status()["host_append_factor"]
    assert expected == pytest.approx(host_s, rel=0.05)


def test_a_probe_is_taken_only_where_the_prior_alone_holds_a_whole_prefix_back() -> None:
    """The slices say the dense append costs 0.75 of the sparse rerun; at the prior (1.3x)
    that is 0.98: held as a close call, or published to measure the host where the judge
    allows a probe. Not where at the prior it is slower than the rerun, nor for a partial
    prefix, nor where the slices themselves do not pay by the margin."""
    model, dense, kw = _whole_prefix_600_tokens_on(host_factor=1.3)
    close = SparseSample(9816, dense / 0.75)
    assert decide(model, **kw, measured=close).verdict is Verdict.HOLD
    probe = decide(model, **kw, measured=close, may_probe=True)
    assert probe.verdict is Verdict.PUBLISH and probe.probes, probe.reason
    assert "to measure the host" in probe.reason and probe.dense_s == pytest.approx(1.3 * dense, rel=0.05)
    dearer = decide(model, **kw, measured=SparseSample(9816, dense / 0.8), may_probe=True)  # 1.04 at the prior
    assert dearer.verdict is Verdict.HOLD and not dearer.probes
    # Once the next prompt has arrived (its real length known), 4 % over the rerun at the
    # prior is within the probe's bar; 8 % is not.
    assert 1.04 < PROBE_BAR_AT_ARRIVAL < 1.079
    arrived = decide(model, **kw, measured=SparseSample(9816, dense / 0.8), may_probe=True,
                     length_known=True)
    assert arrived.verdict is Verdict.PUBLISH and arrived.probes, arrived.reason
    dearest = decide(model, **kw, measured=SparseSample(9816, dense / 0.83), may_probe=True,
                     length_known=True)
    assert dearest.verdict is Verdict.HOLD and not dearest.probes
    partial = decide(model, **(kw | {"boundary": 8960}), measured=close, may_probe=True)
    assert partial.verdict is Verdict.HOLD and not partial.probes
    noisy = DenseCostModel()
    for c, scale in ((0, 0.8), (3072, 1.2), (6144, 0.8), (9216, 1.2)):
        noisy.observe(c, 512, scale * 2e-3 * 512)
    unsure = decide(noisy, **kw, measured=SparseSample(9816, noisy.seconds(600, 9216) / 0.75), may_probe=True)
    assert unsure.verdict is Verdict.HOLD and not unsure.probes, unsure.reason


def test_a_conversation_that_has_not_grown_yet_is_judged_at_the_growth_the_others_showed() -> None:
    """An agent that reads files appends thousands of tokens a turn. Before a conversation
    has grown, the 512 tokens assumed make its dense append look cheap; a publication then
    turns it dense for good. Once another conversation on the server has grown by 2,600,
    the new one's first gap is judged at that growth, and its own growth speaks once seen."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    first, second = RecoveryJob(1, tuple(range(8704)), 8704), RecoveryJob(2, tuple(range(1, 8705)), 8704)
    counters.advance(10.0, others=0.0)
    judge.note_route(second, _sparse_turn(8704, 6.0, "b1"), appended=None, now=0.0)
    for context in range(0, 8704, 1024):  # ~2.9 ms a token at 9k, x1.2 for the host: 512 cost ~1.8 s
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (2e-3 + 1e-7 * (context + 512)))
    assert judge.status()["new_conversation_append"] == 512
    assert judge.judge(second, 8704).verdict is Verdict.PUBLISH
    # The other conversation's second turn grew by 2,600: a dense append of that over
    # 8,704 costs ~9 s, the sparse rerun ~7.8 s.
    judge.note_route(first, _sparse_turn(11304, 7.8, "a2"), appended=2600, now=1.0)
    assert judge.status()["new_conversation_append"] == 2600
    held = judge.judge(second, 8704)
    assert held.verdict is not Verdict.PUBLISH and held.dense_s is not None and held.sparse_s is not None
    assert held.dense_s > held.sparse_s, held.reason
    judge.note_route(second, _sparse_turn(9304, 6.3, "b2"), appended=600, now=2.0)  # its own growth: short
    assert judge.judge(second, 8704).verdict is Verdict.PUBLISH


def test_a_published_conversations_dense_turns_tell_the_growth_and_a_new_one_sharing_a_system_prompt_does_not() -> None:
    """A conversation published at its first gap goes on with dense turns, which the host
    reports with no sparse route: their growth (the uncached part over the restored
    prefix) is what the next conversation should be judged at. A new conversation whose
    only cached tokens are a shared system prompt has grown by nothing."""
    judge = PublishJudge(PublishPolicy.AUTO, 256)
    judge.observe_turn(None, RequestPrefilled("e", "s", "m", tuple(range(4000)), 1024, Route.DENSE, 2.0))
    assert judge.status()["new_conversation_append"] == 512
    judge.observe_turn(None, RequestPrefilled("e", "a2", "m", tuple(range(11579)), 8704, Route.DENSE, 6.0))
    assert judge.status()["new_conversation_append"] == 2875


def _door_turn(tokens: int, seconds: float, door_s: float, request_id: str) -> Any:
    from mlx_recovery_plugin.events import SparseRouteServed

    return SparseRouteServed("e", request_id, "m", tuple(range(tokens)), 0, tokens, threshold=8192, keep=0.2,
                             prefill_s=seconds, door_s=door_s)


def test_the_doors_rereading_of_a_prompt_is_learned_from_the_hosts_reruns_and_weighed() -> None:
    """oMLX's draft keeps its reading of a conversation, but re-scoring still costs: on the
    real server a first turn's 8,594 tokens took 3.4 s at the door and the next turn's
    2,830 new tokens on 8,448 read before 2.2 s, twice their cost at the first turn's
    rate. Counted as free, the re-reading made the rerun look ~1.5 s cheaper than it was
    and held back a publication that pays."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    counters.advance(10.0, others=0.0)
    first = RecoveryJob(1, tuple(range(8594)), 8594)
    judge.note_route(first, _door_turn(8594, 6.4, 3.4, "a1"), appended=None, now=0.0)
    for context in range(0, 11264, 1024):
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (1.4e-3 + 5e-8 * (context + 512)))
    job = RecoveryJob(1, tuple(range(11278)), 11278)
    assert judge.status()["door_growth_per_1k_read"] == 0.0  # nothing measured: counted as free
    # The conversation came back sparse (held): its door re-read 8,448 tokens.
    judge.note_route(job, _door_turn(11278, 6.0, 2.2, "a2"), appended=2684, now=1.0)
    growth = judge.status()["door_growth_per_1k_read"]
    assert growth == pytest.approx(1000 * (2.2 / (3.4 / 8594 * 2684) - 1) / 8594, abs=0.001)  # ~0.12
    assert judge.status()["door_growth_measured"] == 1
    decision = judge.judge(job, 11264)
    assert decision.verdict is Verdict.PUBLISH, decision.reason
    # The same judge with the growth forgotten (the re-reading counted as free) holds back.
    from mlx_recovery_plugin.recovery.door_reading import DoorGrowth

    judge._door = DoorGrowth()
    held = judge.judge(job, 11264)
    assert held.verdict is Verdict.HOLD and "not yet clear" in held.reason, held.reason


def test_the_judge_probes_a_close_call_at_the_arrival_that_it_holds_in_idle_time() -> None:
    """The same whole prefix and the same next length, 4 % over the sparse rerun at the
    prior: held in idle time (the length is a guess there), published as the probe when
    the prompt has arrived; after one host turn has measured the factor, no more probes.
    The prompt leaves half a block uncached, as a later turn does on average, so the turns
    the probe commits cost what it does."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    judge = PublishJudge(PublishPolicy.AUTO, 256)
    for context in range(0, 9216, 1024):
        judge.observe(context, 1024, 1024 * 2e-3)
    job = RecoveryJob(1, tuple(range(9344)), 9344)
    judge.note_route(job, _sparse_turn(9344, 1.5, "a1"), appended=None, now=0.0)
    ratio = judge.judge(job, 9216)
    assert ratio.dense_s is not None and ratio.sparse_s is not None
    # Re-time the sparse turn so that at the prior the dense append is 1.04x its rerun.
    judge.note_route(job, _sparse_turn(9344, 1.5 * ratio.dense_s / ratio.sparse_s / 1.04, "a1"), appended=None, now=0.0)
    idle = judge.judge(job, 9216)
    assert idle.verdict is Verdict.HOLD and "not yet clear" in idle.reason
    assert idle.dense_s == pytest.approx(1.04 * idle.sparse_s, rel=0.01)
    arrived = judge.judge(job, 9216, next_tokens=9344 + DEFAULT_APPEND_TOKENS)
    assert arrived.verdict is Verdict.PUBLISH and arrived.probes, arrived.reason
    assert judge.status()["host_probe"]["taken"] == 1


def test_at_a_request_a_held_prefix_that_would_lose_stays_held_and_the_job_is_not_stood_down() -> None:
    """Seen on the real server (4,096-wide, 4 layers, 8 key/value heads): recovery held 9,216
    of a 10,496-token prefix when the next request came with 2,095 tokens past it. That
    request's dense turn would lose, and the verdict read "stand down ... on this model and
    machine" though the whole prefix paid. At a request the verdict is for that request:
    a hold, and the whole prefix, judged in the next gap, pays."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    judge = PublishJudge(PublishPolicy.AUTO, 256)
    for context in range(0, 10496, 1024):
        judge.observe(context, 1024, 1024 * 2e-3)
    job = RecoveryJob(1, tuple(range(10707)), 10707)
    judge.note_route(job, _sparse_turn(10707, 2.0, "a1"), appended=603, now=0.0)
    at_request = judge.judge(job, 9216, next_tokens=11311)
    assert at_request.verdict is Verdict.HOLD, at_request.reason
    assert "not published for this request over the 9216 tokens held" in at_request.reason
    assert judge.status()["verdict"] == "hold"
    assert judge.judge(job, 10496).verdict is Verdict.PUBLISH


def test_at_a_request_a_held_partial_prefix_is_not_published_before_the_dense_cost_is_known() -> None:
    """Seen on the real server (3072x4, the machine loaded through the first turn): the
    slices had run under load, the quiet machine's cost model had 2 samples, and at the
    next request the 7,168 tokens held of 9,472 were published as "full prefix; dense cost
    not yet learned": at a request what is held is all that can be reached, so it passed
    for the whole prefix, and the turn went dense over 2,935 new tokens at 2.38x its
    sparse route. A partial prefix waits for the cost; the whole one still goes out."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    judge = PublishJudge(PublishPolicy.AUTO, 256)
    job = RecoveryJob(1, tuple(range(9499)), 9499)
    judge.note_route(job, _sparse_turn(9499, 7.7, "a2"), appended=604, now=0.0)
    assert not judge.costs.fitted
    partial = judge.judge(job, 7168, next_tokens=10103)
    assert partial.verdict is Verdict.HOLD, partial.reason
    assert judge.judge(job, 9472, next_tokens=10103).verdict is Verdict.PUBLISH


def test_attention_is_not_timed_while_other_processes_load_the_machine() -> None:
    """The probe's few queries, timed while other processes hold the cores, read 7-23x
    their quiet cost (a real pass 2-3x): a prefix beyond the slices' evidence is timed on
    a quiet machine only."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    counters = Counters()
    judge = _judge_with(counters)
    job = RecoveryJob(1, tuple(range(9216)), 9216)
    judge.note_route(job, _sparse_turn(9216, 10.0), appended=600, now=0.0)
    for context in (0, 1024, 2048):
        counters.advance(5.0, others=0.0)
        judge.observe(context, 1024, 1024 * (1e-4 + 4e-7 * (context + 512)))
    assert judge.regime.value == "quiet" and judge.attention_wanted(job) == 9816
    for context in (3072, 4096, 5120):  # the loaded regime's own model, as far from 9.8k
        counters.advance(5.0, others=1.0)
        judge.observe(context, 1024, 2 * 1024 * (1e-4 + 4e-7 * (context + 512)))
    assert judge.regime.value == "busy" and judge.costs.wants_attention(600, 9216)
    counters.advance(5.0, others=1.0)
    assert judge.attention_wanted(job) is None
    counters.advance(5.0, others=0.0)
    assert judge.attention_wanted(job) == 9816 and judge.regime.value == "quiet"


def _flat_prefix(
    growth: int, ratio: float, host_factor: float = 1.0, threshold: int = 8192, tail: int = 0,
) -> tuple[DenseCostModel, dict[str, Any]]:
    """Slices at 2 ms a token at any context, a whole 9,216-token prefix of a prompt
    ``tail`` tokens longer (0: it ends on a block) on a host of 256-token blocks, the next
    turn ``growth`` tokens on, its sparse rerun timed so that the next turn's dense append
    (growth and tail) at ``host_factor`` is ``ratio`` of it; ``decide``'s arguments, the
    turn after next among them."""
    model = fitted(2e-3, 0.0, contexts=(0, 3072, 6144, 9216))
    next_tokens = 9216 + tail + growth
    dense = model.seconds(growth + tail, 9216)
    assert dense is not None
    sparse = SparseSample(next_tokens, host_factor * dense / ratio)
    later = later_turn(model, next_tokens=next_tokens, growth=growth, block_size=256, threshold=threshold,
                       keep=1.0, measured=sparse, cheapest=None, host_factor=host_factor)
    return model, dict(boundary=9216, full_boundary=9216, next_tokens=next_tokens, threshold=threshold, keep=1.0,
                       measured=sparse, host_factor=host_factor, later=later)


def test_a_publication_weighs_the_later_turns_it_commits_to_the_dense_route() -> None:
    """The host caches a dense turn to its last whole block, so a published conversation's
    later turns append their growth plus half a block on average, where this next turn,
    its prompt ending on a block, appends its growth alone: at 300 tokens a turn that is
    1.43x the next turn's append, and a next turn at 0.8 of its sparse rerun means later
    turns at 1.1: held, saying so. Weighed at one turn (no block size) it would publish;
    at 2,000 tokens a turn the tail is small beside the growth and it publishes."""
    model, kw = _flat_prefix(300, 0.8)
    held = decide(model, **kw)
    assert held.verdict is Verdict.HOLD and "later turns are dense too" in held.reason, held.reason
    assert decide(model, **(kw | {"later": None})).verdict is Verdict.PUBLISH
    model, kw = _flat_prefix(2000, 0.8)
    assert decide(model, **kw).verdict is Verdict.PUBLISH
    # Later turns whose uncached part passes the host's threshold stay sparse: not weighed.
    model, kw = _flat_prefix(300, 0.8, threshold=400)
    assert kw["later"] is None and decide(model, **kw).verdict is Verdict.PUBLISH


def test_a_probe_commits_only_later_turns_that_pay_by_the_margin_at_the_slices_own_cost() -> None:
    """At the arrival the next turn reads 1.02 of its rerun at the host's prior (0.85 at the
    slices' cost): a probe where its later turns pay by the margin at the slices' cost (2,000
    tokens a turn: 0.77 of their rerun). Not where they would merely not lose there (600
    tokens a turn over a prompt ending on a block: 0.97; at a host factor like the prior's
    they would take 1.17x the rerun, every turn from then on), nor where they lose even
    at the slices' cost (300: 1.18)."""
    probe: dict[str, Any] = dict(may_probe=True, length_known=True, host_measured=False)
    model, kw = _flat_prefix(2000, 1.02, host_factor=HOST_APPEND_PRIOR)
    taken = decide(model, **kw, **probe)
    assert taken.verdict is Verdict.PUBLISH and taken.probes, taken.reason
    for growth, later_ratio in ((600, 0.97), (300, 1.18)):
        model, kw = _flat_prefix(growth, 1.02, host_factor=HOST_APPEND_PRIOR)
        assert kw["later"].dense_s / kw["later"].sparse_s == pytest.approx(later_ratio, abs=0.01)
        held = decide(model, **kw, **probe)
        assert held.verdict is Verdict.HOLD and not held.probes and "later turns are dense too" in held.reason
        assert decide(model, **(kw | {"later": None}), **probe).probes


def test_the_status_shows_the_turn_after_next_that_the_last_verdict_weighed() -> None:
    """A conversation of 9,216 tokens that grew by 300 at its last turn: the turn after
    next is a 9,816-token prompt appending 300 plus half a 256-token block, and the status
    shows it beside the verdict, at the host's factor."""
    from mlx_recovery_plugin.recovery.jobs import RecoveryJob

    judge = PublishJudge(PublishPolicy.AUTO, 256)
    for context in range(0, 9216, 1024):
        judge.observe(context, 1024, 1024 * 2e-3)
    job = RecoveryJob(1, tuple(range(9216)), 9216)
    judge.note_route(job, _sparse_turn(9216, 3.0, "a2"), appended=300, now=0.0)
    decision = judge.judge(job, 9216)
    later = judge.status()["turn_after_next"]
    assert decision.later is not None and later is not None
    assert later["prompt_tokens"] == 9816 and later["uncached_tokens"] == 428
    assert later["dense_append_s"] == pytest.approx(428 * 2e-3 * HOST_APPEND_PRIOR, rel=0.05)
    assert later["sparse_rerun_s"] > 0 and later["host_factor"] == pytest.approx(HOST_APPEND_PRIOR)
    # Another conversation's dense turn at half the slices' cost moves the host's factor;
    # until the next verdict the status still shows what the last one weighed.
    judge.observe_turn(None, RequestPrefilled("e", "o", "m", tuple(range(2048)), 1024, Route.DENSE,
                                              0.5 * judge.costs.seconds(1024, 1024)))
    assert judge.status()["host_append_factor"] < 0.6
    assert judge.status()["turn_after_next"] == later


def test_a_whole_prefix_whose_later_turns_only_the_factor_decides_runs_on_for_the_hosts_first_dense_turn() -> None:
    """1,000 tokens a turn over a prompt ending on a block: the next turn reads 0.89 of its
    rerun at the slices' cost (1.07 at the prior), the turn after next 0.91. At a measured
    factor of 0.95 or less both pay by the margin: the hold is the prior's alone, not
    settled, so the job runs on and is whole when the host's first dense turn (another
    conversation's probe) decides it. (No probe of its own: its later turns do not pay by
    the margin at the slices' cost.)"""
    model, kw = _flat_prefix(1000, 0.89 * HOST_APPEND_PRIOR, host_factor=HOST_APPEND_PRIOR)
    assert kw["later"] is not None
    later_ratio = kw["later"].dense_s / kw["later"].sparse_s
    assert 0.9 < later_ratio <= 1.0
    held = decide(model, **kw, host_measured=False)
    assert held.verdict is Verdict.HOLD and not held.settled, held.reason
    assert "the host's first dense turn" in held.reason
    measured = decide(model, **(kw | {"host_factor": 0.95}))
    assert measured.verdict is Verdict.PUBLISH, measured.reason


def test_a_whole_prefix_is_published_where_the_next_turn_is_no_slower_and_the_later_turns_pay_at_a_measured_factor() -> None:
    """The whole 9,216-token prefix of a 9,416-token prompt: the next turn appends its
    600-token growth plus the prompt's 200-token tail, at a measured host factor of 1.08
    0.95 of its sparse rerun (inside the margin), and the turns after it append 600 plus
    half a block, at 0.82 of theirs. Published: the conversation gains from the next turn
    on. Held "not yet clear" (settled: the job pauses) where no later turn can be told, where
    the later turns would not pay by the margin (a prompt ending on a block: the next turn
    is the cheapest), where the next turn is expected slower, and at the prior."""
    factor = 1.08

    def case(growth: int, tail: int, ratio: float) -> dict[str, Any]:
        return _flat_prefix(growth, ratio, host_factor=factor, tail=tail)[1]

    model, kw = _flat_prefix(600, 0.95, host_factor=factor, tail=200)
    assert kw["later"] is not None
    assert factor * kw["later"].dense_s / kw["later"].sparse_s == pytest.approx(0.82, abs=0.01)
    published = decide(model, **kw)
    assert published.verdict is Verdict.PUBLISH and "later turns pay" in published.reason, published.reason
    assert published.dense_s is not None and published.sparse_s is not None
    assert published.dense_s == pytest.approx(0.95 * published.sparse_s, rel=0.01)

    def held(**kw: Any) -> None:
        decision = decide(model, **kw)
        assert decision.verdict is Verdict.HOLD and "not yet clear" in decision.reason, decision.reason
        assert decision.settled

    held(**(kw | {"later": None}))
    flush = case(600, 0, 0.95)
    assert flush["later"] is not None and factor * flush["later"].dense_s / flush["later"].sparse_s > 0.9
    held(**flush)
    held(**case(600, 200, 1.03))
    at_prior = decide(model, **kw, host_measured=False)
    assert at_prior.verdict is Verdict.HOLD and "not yet clear" in at_prior.reason, at_prior.reason
