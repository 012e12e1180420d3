"""``bench policy``: its verdict bookkeeping, its load, and a quick matrix end to end on
the real oMLX scheduler (tiny models; timings are reported, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.bench.policy.cells import Cell, parse_shape, quick_matrix
from mlx_recovery_plugin.bench.policy.load import CompetingLoad
from mlx_recovery_plugin.bench.policy.measure import CellResult
from mlx_recovery_plugin.bench.policy.report import PolicyReport, format_report
from mlx_recovery_plugin.cli import main
from mlx_recovery_plugin.recovery import machine_load
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec

# Taken before the suite's fixture hides the machine's counters (``conftest.quiet_machine``).
REAL_COUNTERS = machine_load.read_counters

CELL = Cell(TinyModelSpec(), 1024, 128, loaded=False)


def result(dense: float, sparse: float, verdict: str, turn: float) -> CellResult:
    return CellResult(CELL, [dense], [sparse], 1024, turn, 1024 if verdict == "published" else 0, verdict)


def test_a_verdict_is_wrong_only_where_the_truth_says_so_and_costs_what_the_turn_lost() -> None:
    # The full prefix makes the next turn 2x faster: standing down cost the difference.
    missed = result(dense=1.0, sparse=2.0, verdict="stood_down", turn=2.0)
    assert (missed.truth, missed.wrong, missed.cost_s) == ("pays", True, pytest.approx(1.0))
    # The dense append is 1.5x the sparse rerun: publishing cost the turn half a second.
    published = result(dense=1.5, sparse=1.0, verdict="published", turn=1.5)
    assert (published.truth, published.wrong, published.cost_s) == ("loses", True, pytest.approx(0.5))
    # Right either way.
    assert not result(dense=1.5, sparse=1.0, verdict="stood_down", turn=1.0).wrong
    assert not result(dense=1.0, sparse=2.0, verdict="published", turn=1.0).wrong
    # Close: either is fine, unless a publication made the turn slower than the sparse route.
    close = result(dense=1.0, sparse=1.1, verdict="held", turn=1.1)
    assert close.truth == "close" and not close.wrong and not close.slow_turn
    partial = result(dense=1.0, sparse=1.1, verdict="partial", turn=1.5)
    partial.recovery_cached = 512
    assert partial.wrong
    # Nothing published and still slower: not the verdict's doing, but a slow turn.
    slow = result(dense=1.0, sparse=1.1, verdict="held", turn=1.5)
    assert not slow.wrong and slow.slow_turn


def test_the_turn_with_recovery_is_judged_against_the_reruns_on_both_sides_of_it(tmp_path: Path) -> None:
    # The machine slowed over the cell (2048x4 loaded at 12,288: the truth's reruns 13.6
    # and 13.8 s, 15.5 s after the turn): a sparse turn of 16.4 s is 1.04x the reruns
    # around it, not 1.19x the truth's.
    slowed = CellResult(CELL, [12.0, 12.1], [13.6, 13.8], 1024, 16.4, 0, "held",
                        sparse_before_s=16.0, sparse_after_s=15.5)
    assert slowed.turn_ratio == pytest.approx(16.4 / 15.75)
    assert not slowed.slow_turn
    assert slowed.drift == pytest.approx(15.75 / 13.7)
    # Reruns around the turn as fast as the truth's: a slow turn is still slow.
    steady = CellResult(CELL, [12.0, 12.1], [13.6, 13.8], 1024, 16.4, 0, "held",
                        sparse_before_s=13.7, sparse_after_s=13.7)
    assert steady.slow_turn and steady.turn_ratio == pytest.approx(16.4 / 13.7)
    # A report written before the rerun before the turn was measured: judged as then.
    older = CellResult(CELL, [12.0, 12.1], [13.6, 13.8], 1024, 16.4, 0, "held", sparse_after_s=15.5)
    assert older.drift is None and older.turn_ratio == pytest.approx(16.4 / 13.8)
    report = PolicyReport([slowed])
    report.write_json(tmp_path / "policy.json")
    again = PolicyReport.read_json(tmp_path / "policy.json").results[0]
    assert (again.sparse_before_s, again.sparse_after_s) == (16.0, 15.5) and not again.slow_turn
    assert "16.00 s and 15.50 s, 1.15x the truth's 13.70 s" in format_report(report)


def test_the_report_counts_the_confusion_matrix_and_names_a_missed_goal() -> None:
    report = PolicyReport([
        result(1.0, 2.0, "stood_down", 2.0), result(1.0, 2.0, "published", 1.0),
        result(1.5, 1.0, "published", 1.5),
    ])
    assert report.confusion()["pays"] == {"published": 1, "not_published": 1}
    assert report.confusion()["loses"] == {"published": 1, "not_published": 0}
    assert list(report.goals().values()) == [False, False, False]
    text = format_report(report)
    assert text.count("MISSED") == 3 and "wrong verdicts: 2" in text


def test_a_stand_down_keeps_its_own_reason_beside_the_policys_last_one(tmp_path: Path) -> None:
    """The policy's last reason may be a later hold; the cell keeps why the job stood down,
    in the printed report and in the JSON."""
    from mlx_recovery_plugin.bench.policy.measure import job_reason

    jobs = [{"paused": None, "stood_down": None}, {"paused": "not yet clear", "stood_down": None},
            {"paused": None, "stood_down": "a cached dense append costs more"}]
    assert job_reason(jobs) == "a cached dense append costs more"
    assert job_reason(jobs[:2]) == "not yet clear" and job_reason(jobs[:1]) is None
    cell = result(dense=1.0, sparse=1.1, verdict="stood_down", turn=1.1)
    cell.policy = {"reason": "a 512-token prefix ... beyond what was measured", "job_reason": job_reason(jobs)}
    report = PolicyReport([cell, result(1.0, 2.0, "published", 1.0)])
    assert f"{CELL.label}: stood_down: a cached dense append costs more" in format_report(report)
    report.write_json(tmp_path / "policy.json")
    assert format_report(PolicyReport.read_json(tmp_path / "policy.json")) == format_report(report)


def test_the_host_factor_is_reported_only_where_the_next_turn_measured_it() -> None:
    from mlx_recovery_plugin.bench.policy.measure import host_factor_after

    assert host_factor_after({"host_append_factor": 1.3, "host_append_measured": 0}) == {
        "host_append_factor_after": None, "host_append_measured_after": 0}  # the prior, not a measurement
    measured = host_factor_after({"host_append_factor": 1.0912, "host_append_measured": 1})
    assert measured == {"host_append_factor_after": 1.0912, "host_append_measured_after": 1}
    cell = result(dense=1.0, sparse=2.0, verdict="published", turn=1.0)
    cell.policy = dict(measured)
    assert f"{CELL.label}: 1.09" in format_report(PolicyReport([cell]))
    assert "measured on the next turn" not in format_report(PolicyReport([result(1.0, 2.0, "held", 2.0)]))


def test_a_wrong_verdict_shows_what_was_decided_at_the_turns_arrival() -> None:
    """The policy's reason before the turn is an idle-time verdict; where publications
    wait for the request, the one that set the turn's route was taken at its arrival."""
    cell = result(dense=1.5, sparse=1.0, verdict="published", turn=1.5)
    cell.policy = {"reason": "dense append 0.5 s < sparse rerun 1.2 s",
                   "at_request": {"verdict": "publish", "reason": "dense append 0.6 s < sparse rerun 1.1 s"}}
    text = format_report(PolicyReport([cell]))
    assert "at the turn's arrival: publish (dense append 0.6 s < sparse rerun 1.1 s)" in text
    assert "at the turn's arrival" not in format_report(PolicyReport([result(1.5, 1.0, "published", 1.5)]))


def test_the_competing_load_runs_one_process_per_core_and_leaves_none_behind() -> None:
    with CompetingLoad(2) as load:
        children = list(load._children)
        assert len(children) == 2 and all(child.poll() is None for child in children)
    assert all(child.returncode is not None for child in children)


def test_a_shape_is_checked_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_shape("2048x4x5632x32x8").num_kv_heads == 8
    with pytest.raises(ValueError, match="heads must divide"):
        parse_shape("1000x2x2000x16x4")
    assert main(["bench", "policy", "--shapes", "64x2", "--no-openblas"]) == 2
    assert "HIDDENxLAYERSxFFNxHEADSxKV" in capsys.readouterr().err
    assert main(["bench", "policy", "--append", "9000", "--no-openblas"]) == 2
    assert "the host's sparse threshold" in capsys.readouterr().err


def test_the_next_turns_growth_is_set_on_the_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mlx_recovery_plugin.bench.policy import run

    class Measured(Exception):
        pass

    def measure(matrix: Any, *args: Any, **kwargs: Any) -> None:
        assert {cell.append for cell in matrix.cells} == {2600}
        raise Measured

    monkeypatch.setattr(run, "run_matrix", measure)
    with pytest.raises(Measured):
        main(["bench", "policy", "--append", "2600", "--shapes", "1024x2x2048x8x2", "--contexts", "8704",
              "--load", "off", "--model-dir", str(tmp_path), "--no-openblas"])


def test_the_quick_matrix_measures_every_cell_on_the_omlx_scheduler(tmp_path: Path) -> None:
    pytest.importorskip("omlx", reason="the oMLX scheduler is installed in .venv-omlx (CI)")
    from mlx_recovery_plugin.bench.policy.run import run_matrix

    matrix = quick_matrix()
    report = run_matrix(matrix, tmp_path, repeats=2)  # every arm checks it left no block reference
    assert len(report.results) == len(matrix.cells) == 8
    for r in report.results:
        assert len(r.dense_append_s) == len(r.sparse_rerun_s) == 2
        assert r.recovery_turns_s == [r.recovery_turn_s]  # a quiet turn is served once
        # The sparse rerun was measured on both sides of the turn with recovery.
        assert r.sparse_before_s is not None and r.sparse_after_s is not None and r.drift is not None
        assert r.dense_cached == r.cell.context  # the dense route cached the whole first turn
        assert r.verdict in ("published", "partial", "held", "stood_down", "nothing")
        if r.published:
            assert r.recovery_cached >= r.dense_cached - matrix.block
            assert r.tokens_recovered >= r.recovery_cached - matrix.block
        assert r.tokens_recovered <= r.tokens_run
    assert sum(sum(row.values()) for row in report.confusion().values()) == 8
    report.write_json(tmp_path / "policy.json")
    saved = json.loads((tmp_path / "policy.json").read_text())
    assert [c["loaded"] for c in saved["cells"]] == [False, True] * 4
    # A loaded cell's load runs through the first turn, not the next one.
    assert [c["load_at_turns"] for c in saved["cells"]] == [[False, False], [True, False]] * 4
    assert set(saved["goals"]) == set(report.goals())
    again = PolicyReport.read_json(tmp_path / "policy.json")
    assert format_report(again) == format_report(report)


def test_a_cell_loaded_at_the_next_turn_serves_that_turn_on_a_busy_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way round from a loaded first turn: the machine is quiet for the first
    turn and the first stretch of idle time, then busy through the next turn, whose truth
    is measured busy too; the policy judges that turn on the busy machine."""
    pytest.importorskip("omlx", reason="the oMLX scheduler is installed in .venv-omlx (CI)")
    import dataclasses

    from mlx_recovery_plugin.bench.policy.run import run_matrix

    # The machine's real counters (the suite hides them): the load here is real.
    monkeypatch.setattr(machine_load, "read_counters", REAL_COUNTERS)
    matrix = quick_matrix(loads=(True,), load_at="next")
    matrix = dataclasses.replace(matrix, cells=matrix.cells[:1])
    report = run_matrix(matrix, tmp_path, repeats=2)
    (r,) = report.results
    assert r.cell.label.endswith("loaded at next")
    assert r.load_at_turns == (False, True)  # quiet first turn, loaded next one
    assert r.policy["regime_at_turn"] == "busy"
    assert r.tokens_recovered <= r.tokens_run
    # The loaded turn is served twice on the route the policy left (nothing new published
    # in between: the same prefix restored), and counts at the median.
    assert len(r.recovery_turns_s) == 2
    assert r.recovery_turns_cached == [r.recovery_cached] * 2
    assert r.recovery_turn_s == pytest.approx(sum(r.recovery_turns_s) / 2)
    report.write_json(tmp_path / "policy.json")
    again = PolicyReport.read_json(tmp_path / "policy.json").results[0]
    assert again.cell.load_at == "next"
    assert again.recovery_turns_s == r.recovery_turns_s


def test_the_competing_load_starts_once_and_stops_in_place() -> None:
    load = CompetingLoad(1)
    try:
        load.start()
        first = list(load._children)
        load.start()  # already running: no second set of loops
        assert load.running and load._children == first and first[0].poll() is None
        load.stop()
        assert not load.running and first[0].returncode is not None
    finally:
        load.stop()
