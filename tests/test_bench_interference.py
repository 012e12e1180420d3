"""The interference bench at toy size: it measures an arrival during real recovery, keeps
waits signed, flags a trial whose probe met no live slice, and treats a missing time to
first token as an error."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from lab import interference
from lab.interference import (
    MissingMeasurement,
    TrialOutcome,
    arrive_after_recovery,
    format_rows,
    run_interference_bench,
    run_trial,
)
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model


@pytest.fixture(scope="module")
def models(tiny_llama_dir, tiny_draft_dir) -> tuple[Any, Any, Any]:
    model, tokenizer = load_tiny_model(tiny_llama_dir)
    draft, _ = load_tiny_model(tiny_draft_dir)
    return model, tokenizer, draft


def test_interference_bench_reports_every_configuration(models) -> None:
    lines: list[str] = []
    report = run_interference_bench(
        slice_sizes=(128,), trials=1, context=1024, probe_len=16, block_size=64,
        models=models, progress=lines.append,
    )
    rows = report.rows
    assert [(r.slice_tokens, r.interruptible) for r in rows] == [(128, True), (128, False)]
    for r in rows:
        # Each trial is either counted in the spread or flagged; none vanishes.
        assert r.trials == 1 and r.not_live + r.baseline_met_slice + (r.extra_wait.n if r.extra_wait else 0) == 1, r
    assert rows[1].slice_seconds > 0  # a whole slice ran and was timed
    assert len(lines) == 3 and lines[0].startswith("cost balance: a token at 1,024 context")
    assert "longest slice" in lines[1] and "extra " in lines[1] and "live slice" in lines[1].lower()
    table = format_rows(report)
    assert "worst/slice" in table and report.balance_line in table and "no live slice" in table


def test_a_probe_sent_after_recovery_is_flagged_as_meeting_no_live_slice(models) -> None:
    outcome = run_trial(models, 128, False, random.Random(0), 512, 64, 16, arrive=arrive_after_recovery)
    assert outcome.live_slice is False and outcome.interrupted is False and not outcome.counted
    assert outcome.baseline_clean  # budget 0 and a drained engine: the baseline met no slice
    assert outcome.during_s > 0 and outcome.baseline_s > 0


def _fake_trials(outcomes: dict[tuple[int, bool], list[TrialOutcome]]) -> Any:
    queues = {k: list(v) for k, v in outcomes.items()}

    def trial(models: Any, slice_tokens: int, interruptible: bool, *rest: Any) -> TrialOutcome:
        return queues[(slice_tokens, interruptible)].pop(0)

    return trial


def _bench_with(models: Any, outcomes: dict[tuple[int, bool], list[TrialOutcome]], trials: int) -> Any:
    lines: list[str] = []
    report = run_interference_bench(
        slice_sizes=(128,), trials=trials, context=1024, models=models, progress=lines.append,
        trial=_fake_trials(outcomes),
    )
    return report, lines


def test_extra_waits_are_signed_never_clamped(models) -> None:
    report, lines = _bench_with(models, {
        (128, True): [TrialOutcome(0.010, 0.030, 0.2, live_slice=True, interrupted=True)],
        (128, False): [TrialOutcome(0.050, 0.020, 0.2, live_slice=True)],
    }, trials=1)
    faster, slower = report.rows
    assert faster.extra_wait is not None and faster.extra_wait.low == pytest.approx(-0.020)
    assert faster.interrupted == 1 and faster.not_live == 0
    assert slower.extra_wait is not None and slower.extra_wait.median == pytest.approx(0.030)
    assert "extra -0.020s" in lines[1] and "interrupted" in lines[1]


def test_a_trial_without_a_live_slice_is_flagged_and_left_out_of_the_spread(models) -> None:
    report, lines = _bench_with(models, {
        (128, True): [TrialOutcome(0.5, 0.1, 0.2, live_slice=True), TrialOutcome(9.0, 0.1, 0.2, live_slice=False)],
        (128, False): [TrialOutcome(0.3, 0.1, 0.2, live_slice=False), TrialOutcome(0.3, 0.1, 0.4, live_slice=False)],
    }, trials=2)
    counted, none_live = report.rows
    assert (counted.trials, counted.not_live) == (2, 1)
    assert counted.extra_wait is not None and counted.extra_wait.n == 1
    assert counted.extra_wait.high == pytest.approx(0.4)  # the 8.9 s of the flagged trial is not in it
    assert none_live.extra_wait is None and none_live.not_live == 2
    assert none_live.slice_seconds == pytest.approx(0.3)  # whole-slice timing still from every trial
    assert sum("NO LIVE SLICE" in line for line in lines) == 3
    table = format_rows(report)
    assert "1/2" in table and "2/2" in table and "n/a (no trial counted)" in table


def test_a_trial_whose_baseline_met_a_slice_is_flagged_and_left_out(models) -> None:
    report, lines = _bench_with(models, {
        (128, True): [TrialOutcome(0.5, 0.1, 0.2, live_slice=True),
                      TrialOutcome(0.5, 1.5, 0.2, live_slice=True, baseline_clean=False)],
        (128, False): [TrialOutcome(0.3, 0.1, 0.2, live_slice=True), TrialOutcome(0.3, 0.1, 0.2, live_slice=True)],
    }, trials=2)
    row = report.rows[0]
    assert (row.not_live, row.baseline_met_slice) == (0, 1)
    assert row.extra_wait is not None and row.extra_wait.n == 1 and row.extra_wait.low == pytest.approx(0.4)
    assert sum("BASELINE MET A SLICE" in line for line in lines) == 1


def test_a_request_without_a_time_to_first_token_is_an_error() -> None:
    host = SimpleNamespace(wait=lambda request_id, timeout: SimpleNamespace(ttft_s=None))
    with pytest.raises(MissingMeasurement, match="probe request p1 got no time to first token"):
        interference._ttft(host, "p1", "probe")  # type: ignore[arg-type]
    host_ok = SimpleNamespace(wait=lambda request_id, timeout: SimpleNamespace(ttft_s=0.0))
    assert interference._ttft(host_ok, "p2", "probe") == 0.0  # type: ignore[arg-type]


def test_interference_takes_a_trained_model_by_name_and_says_how_to_fetch_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lab.cli import main as lab_main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert lab_main(["interference", "--no-openblas", "--model", "smollm2"]) == 2
    assert "run `mlx-recovery models fetch smollm2`" in capsys.readouterr().err
