"""The publish policy's arithmetic: a dense cost fitted to slices, the sparse rerun it is
compared with, and the verdict for each situation a conversation can be in."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.recovery.costs import (
    DenseCostModel,
    SparseSample,
    Verdict,
    decide,
    sparse_rerun_seconds,
)


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


def test_a_prefix_that_leaves_the_next_turn_sparse_is_published() -> None:
    model = fitted(**ATTENTION_BOUND)
    assert verdict(model, 512) is Verdict.PUBLISH  # 9,288 uncached > 8,192: still sparse


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
