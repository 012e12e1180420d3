"""mlx-lm's own server (``python -m mlx_lm.server``, a subprocess on 127.0.0.1) with the
plugin attached from the environment alone, over HTTP: the adopter restores the block
floor of partial matches on the hybrid and sliding-window models, answers as a cold
server does, and adds nothing on a trimmable model. Every server is killed in ``finally``
(:func:`~mlx_recovery_plugin.testing.mlx_lm_server.serving`)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sysconfig
from pathlib import Path

import pytest

from mlx_recovery_plugin.bench.adopter_mlx_lm import PARTIAL_WORKLOADS, MlxLmBenchReport, run_mlx_lm_bench, workload
from mlx_recovery_plugin.bench.mlx_lm_long_run import LongRun, run_long_run
from mlx_recovery_plugin.hosts.mlx_lm.instrumentor import mlx_lm_version, version_supported
from mlx_recovery_plugin.testing.mlx_lm_models import SPECS
from mlx_recovery_plugin.testing.mlx_lm_server import plugin_environment, serving
from mlx_recovery_plugin.testing.tiny_model import cached_model_dir

PTH = Path(sysconfig.get_paths()["purelib"]) / "mlx_recovery_plugin.pth"

pytestmark = [
    pytest.mark.skipif(not version_supported(mlx_lm_version()), reason="mlx-lm version the adapter refuses"),
    pytest.mark.skipif(not PTH.exists(), reason="the start-up hook is not in site-packages (.ci/run copies it)"),
]

BLOCK = 64


@pytest.fixture(scope="module")
def report() -> MlxLmBenchReport:
    return run_mlx_lm_bench(block=BLOCK, doc_chars=400, requests=2, use_sdk=False)


def test_bench_restores_the_block_floor_on_partial_matches_and_nothing_extra_on_the_reference(
    report: MlxLmBenchReport,
) -> None:
    for model in ("hybrid", "sliding"):
        for name in PARTIAL_WORKLOADS:
            off, on = report.row(model, name, "without"), report.row(model, name, "with")
            assert off is not None and on is not None
            assert on.floor_tokens > 0
            assert on.cached_tokens >= 0.9 * on.floor_tokens, (model, name, on.cached_tokens, on.floor_tokens)
            assert off.cached_tokens < 0.5 * on.floor_tokens  # the host alone loses the match
            assert on.texts == off.texts and all(on.texts)  # the same greedy answers, streamed whole
    for row in (r for r in report.rows if r.model == "reference"):
        assert (row.cuts, row.snapshot_bytes_stored, row.snapshot_bytes) == (0, 0, 0)
    assert report.goals_met


def test_every_bench_request_reports_its_time_to_first_token_and_each_workload_its_ratio(
    report: MlxLmBenchReport,
) -> None:
    for row in report.rows:
        assert len(row.ttft_s) == row.requests and all(t > 0 for t in row.ttft_s)
        assert row.ttft_median_s == statistics.median(row.ttft_s[1:])
    rows = report.to_dict()["rows"]
    for out in rows:
        compared = out["arm"] == "with" and out["model"] != "reference"  # the reference runs with the plugin only
        assert (out["ttft_with_over_without"] is not None) == compared, out
        if compared:
            off = next(r for r in rows if (r["model"], r["workload"], r["arm"]) == (out["model"], out["workload"], "without"))
            assert out["ttft_with_over_without"] == pytest.approx(out["ttft_median_s"] / off["ttft_median_s"])
    assert "TTFT w/o ms" in report.format_table()


@pytest.fixture(scope="module")
def long_run() -> LongRun:
    return run_long_run("hybrid", documents=8, doc_chars=300, block=BLOCK, budget_snapshots=2, use_sdk=False)


def test_the_snapshot_budget_holds_over_a_long_run_and_the_newest_documents_siblings_are_adopted(
    long_run: LongRun,
) -> None:
    run = long_run
    assert len(run.held_bytes) == 16  # read after every request
    assert 0 < max(run.held_bytes) <= run.budget_bytes == 2 * run.snapshot_bytes_each
    assert run.evicted_budget > 0 and run.faults == 0
    assert run.stored * run.snapshot_bytes_each == run.bytes_stored  # the budget was sized in the server's snapshots
    assert run.sibling_floor[-1] > 0 and run.sibling_cached[-1] >= run.sibling_floor[-1]
    out = run.to_dict()
    assert out["within_budget"] and out["late_share"] >= 0.9 and out["goal_met"]
    assert out["peak_bytes"] == max(run.held_bytes)


def test_the_command_writes_the_json_with_its_long_run_and_a_plot(
    report: MlxLmBenchReport, long_run: LongRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mlx_recovery_plugin import cli
    from mlx_recovery_plugin.bench import adopter_mlx_lm

    asked: dict[str, object] = {}

    def bench(**kwargs: object) -> MlxLmBenchReport:  # the fixtures' runs stand in for the bench's
        asked.update(kwargs)
        return dataclasses.replace(report, long_run=[long_run])

    monkeypatch.setattr(adopter_mlx_lm, "run_mlx_lm_bench", bench)
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    assert cli.main(["bench", "adopter", "--host", "mlx_lm", "--long-run", "8", "--long-run-snapshots", "2",
                     "--out", str(out), "--plot", str(plot), "--no-openblas"]) == 0
    assert (asked["long_run_documents"], asked["long_run_snapshots"]) == (8, 2)
    (written,) = json.loads(out.read_text())["long_run"]
    assert written["budget_bytes"] == long_run.budget_bytes and written["goal_met"]
    assert "long run, hybrid: 8 documents" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind", ["hybrid", "sliding"])
def test_an_adopted_request_answers_as_a_cold_server_does(kind: str) -> None:
    path = cached_model_dir(SPECS[kind])
    first, second = workload("shared_document", 300, 2, seed=3)
    messages = [[{"role": r, "content": c} for r, c in req.messages] for req in (first, second)]
    with serving(path, plugin_environment(True, BLOCK)) as client:
        client.chat(messages[0])
        adopted = client.chat(messages[1])
        status = client.status()
    with serving(path, plugin_environment(False, BLOCK)) as client:
        cold = client.chat(messages[1])
        assert client.status() is None  # no plugin there: the route is the host's 404
    assert adopted.cached_tokens >= BLOCK and cold.cached_tokens == 0
    assert adopted.text == cold.text
    assert len(adopted.logprobs) == len(cold.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(adopted.logprobs, cold.logprobs)) < 1e-4
    assert status is not None and status["adopter"]["reasons"] == {"partial": 1}
    assert status["snapshots"]["bytes"] > 0 and status["faults"] == 0
