"""``bench server --repeats``: the sparse-on / recovery pair served again, alternating
which goes first, each concurrent repeat on another schedule, with the spread of the
ratios and the host's own sparse-route seconds from its log. The server runs are
stand-ins here (what is tested is the orchestration and the arithmetic); the real oMLX
server's log is parsed in tests/test_server_bench_concurrent.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_recovery_plugin.bench.server import run as run_mod
from mlx_recovery_plugin.bench.server import sessions
from mlx_recovery_plugin.bench.server.hosts import OMLX, RAPID, sparse_seconds
from mlx_recovery_plugin.bench.server.models import ModelPair
from mlx_recovery_plugin.bench.server.repeats import repeats_summary
from mlx_recovery_plugin.bench.server.report import ArmRun, BenchReport, SessionResult, StepRecord, format_session

OMLX_LINES = """\
2026-12-02 04:54:55,636 - omlx.scheduler - INFO - SpecPrefill: scored 8594 tokens in 3.7s, selected 1728/8594 (keep=20%, prompt 8895 = system 301 + conv 8594, cached 0)
2026-12-02 04:54:56,918 - omlx.scheduler - INFO - SpecPrefill: system prompt 301 tokens full prefill
2026-12-02 04:55:05,506 - omlx.scheduler - INFO - SpecPrefill: sparse prefill 1728/8594 conv tokens in 9.8s (total 8895, cached 0, system 301 full, conv 8594 sparse)
2026-12-02 04:55:07,000 - omlx.server - INFO - Chat completion: 2 tokens in 13.40s (0.3 tok/s), prompt: 9499
"""


def test_the_host_sparse_seconds_are_the_scoring_and_the_sparse_prefill_its_log_reports() -> None:
    assert sparse_seconds(OMLX, OMLX_LINES) == pytest.approx(13.5)
    assert sparse_seconds(OMLX, "no sparse route here\n") == 0.0
    assert sparse_seconds(RAPID, OMLX_LINES) is None  # rapid-mlx's log does not say


def _arm(arm: str, ttfts: list[float], host_s: float | None, recovered: int | None = None) -> ArmRun:
    run = ArmRun(arm, host_sparse_s=host_s)
    for i, t in enumerate(ttfts):
        status = {"tokens_recovered": recovered} if recovered is not None else None
        run.steps.append(StepRecord(i + 1, "A", i + 1, "", 9000 + i, 0, t, t, 0.0, status=status))
    return run


def test_repeats_alternate_the_first_arm_and_change_the_concurrent_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[tuple[str, list[tuple[str, int, float, float]], str]] = []
    on_sums = iter([10.0, 12.0, 11.0])
    rec_sums = iter([9.0, 13.2, 9.9])

    def fake_run_arm(config, pair, session, arm, root, progress, not_before=None):
        served.append((arm, [(s.conversation, s.turn, s.start_s, s.think_s) for s in session.steps], root.name))
        if arm == "sparse_off":
            return _arm(arm, [20.0, 1.0], None)
        total = next(on_sums if arm == "sparse_on" else rec_sums)
        return _arm(arm, [0.0, total], 8.0 if arm == "sparse_on" else 8.4, recovered=0 if arm != "sparse_on" else None)

    monkeypatch.setattr(run_mod, "run_arm", fake_run_arm)
    config = run_mod.BenchConfig(workdir=tmp_path, repeats=3, shape=sessions.Shape(context_chars=400, turns=2))
    session = sessions.build("concurrent", config.shape, 30.0, 3)
    result = SessionResult("concurrent", session.description, concurrent=True)
    run_mod._serve_arms(config, ModelPair(tmp_path, "t", "d"), "concurrent", session, result, lambda line: None)

    assert [arm for arm, _, _ in served] == ["sparse_off", "sparse_on", "sparse_recovery", "sparse_recovery",
                                            "sparse_on", "sparse_on", "sparse_recovery"]
    # Each pair on one schedule, each repeat on another; sparse off on the first.
    schedules = [sched for _, sched, _ in served]
    assert schedules[0] == schedules[1] == schedules[2]
    assert schedules[3] == schedules[4] != schedules[1]
    assert schedules[5] == schedules[6] not in (schedules[1], schedules[3])
    assert len({root for _, _, root in served}) == len(served)  # every run in a directory of its own
    assert [p.seed for p in result.repeats] == [11, 12, 13]
    assert [p.first for p in result.repeats] == ["sparse_on", "sparse_recovery", "sparse_on"]
    assert result.arms["sparse_on"] is result.repeats[0].sparse_on  # the first pair is the session's arms

    report = BenchReport("t", "d", "h", "b", 50.0, 30.0, 1.0, 2, "auto", sessions=[result])
    summary = report.to_json()["summary"]["concurrent"]["repeats"]
    assert [p["ratio"] for p in summary["pairs"]] == [0.9, 1.1, 0.9]
    assert summary["ratio"] == {"median": 0.9, "min": 0.9, "max": 1.1, "n": 3}
    assert summary["host_sparse_ratio"]["median"] == pytest.approx(1.05)
    # One later turn per run (turn 2): its spread per arm over the repeats.
    assert summary["later_turns_s"]["sparse_on"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 3}
    assert summary["later_turns_s"]["sparse_recovery"]["max"] == 13.2
    json.dumps(report.to_json())  # the whole report stays JSON
    text = "\n".join(format_session(result))
    assert "repeats (3 pairs" in text and "median 0.90x [0.90, 1.10]" in text
    assert "seed 12 (sparse recovery first)" in text


def test_one_run_has_no_repeats_and_the_bench_refuses_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_mod, "run_arm", lambda config, pair, session, arm, root, progress, not_before=None: _arm(arm, [1.0], None))
    config = run_mod.BenchConfig(workdir=tmp_path)
    result = SessionResult("agent", "test")
    run_mod._serve_arms(config, ModelPair(tmp_path, "t", "d"), "agent", sessions.build("agent", config.shape, 1.0),
                        result, lambda line: None)
    assert list(result.arms) == ["sparse_off", "sparse_on", "sparse_recovery"] and result.repeats == []
    assert not any("repeats" in line for line in format_session(result))

    from mlx_recovery_plugin.bench.server.cli import _config
    from mlx_recovery_plugin.cli import build_parser

    assert _config(build_parser().parse_args(["bench", "server", "--repeats", "3"]), tmp_path).repeats == 3
    with pytest.raises(ValueError, match="at least 1"):
        _config(build_parser().parse_args(["bench", "server", "--repeats", "0"]), tmp_path)


def test_a_turn_slow_in_one_pair_only_does_not_decide_the_worst_later_turn_but_one_slow_in_all_does() -> None:
    from mlx_recovery_plugin.bench.server.repeats import RepeatPair, repeats_summary, worst_turn_median

    on = [10.0, 5.0, 5.0]
    drift = [RepeatPair(11, "sparse_on", _arm("sparse_on", on, None), _arm("sparse_recovery", r, None))
             for r in ([9.0, 5.0, 5.0], [9.0, 7.5, 5.0], [9.0, 5.0, 5.1])]  # turn 2 slow once (1.5x)
    assert worst_turn_median(drift) == pytest.approx(1.0)
    slow = [RepeatPair(11, "sparse_on", _arm("sparse_on", on, None), _arm("sparse_recovery", r, None))
            for r in ([9.0, 6.0, 5.0], [9.0, 6.5, 5.0], [9.0, 6.0, 5.1])]  # turn 2 slow in every pair
    assert worst_turn_median(slow) == pytest.approx(1.2)
    assert repeats_summary(slow)["worst_later_turn_median_vs_on"] == pytest.approx(1.2)
    concurrent = drift[:1] + [RepeatPair(12, "sparse_on", _arm("sparse_on", on[:2], None),
                                         _arm("sparse_recovery", on[:2], None))]
    assert worst_turn_median(concurrent) is None  # the pairs served different steps


def test_the_first_turns_spread_is_reported_as_the_floor_the_later_turns_are_read_against() -> None:
    """First turns have nothing to restore: their ratios (0.9x and 1.1x here) say how far
    the arms differ without recovery; a later turn twice as slow is not one of them."""
    from mlx_recovery_plugin.bench.server.repeats import RepeatPair, repeat_lines, repeats_summary

    on = [10.0, 5.0, 5.0]
    pairs = [RepeatPair(11, "sparse_on", _arm("sparse_on", on, None), _arm("sparse_recovery", [9.0, 10.0, 5.0], None)),
             RepeatPair(12, "sparse_on", _arm("sparse_on", on, None), _arm("sparse_recovery", [11.0, 5.0, 5.0], None))]
    first = repeats_summary(pairs)["first_turns_vs_on"]
    assert first == {"median": pytest.approx(1.0), "min": pytest.approx(0.9), "max": pytest.approx(1.1), "n": 2}
    assert any("first turns" in line and "[0.90, 1.10] over 2" in line for line in repeat_lines(pairs))


def test_with_sparse_ons_arrivals_sparse_on_goes_first_and_the_recovery_arm_waits_for_its_own_pairs_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[tuple[str, ArmRun | None, ArmRun]] = []

    def fake_run_arm(config, pair, session, arm, root, progress, not_before=None):
        run = _arm(arm, [1.0, 2.0], None)
        served.append((arm, not_before, run))
        return run

    monkeypatch.setattr(run_mod, "run_arm", fake_run_arm)
    config = run_mod.BenchConfig(workdir=tmp_path, repeats=2, arrivals="sparse-on",
                                 shape=sessions.Shape(context_chars=400, turns=2))
    session = sessions.build("concurrent", config.shape, 30.0, 3)
    result = SessionResult("concurrent", session.description, concurrent=True)
    run_mod._serve_arms(config, ModelPair(tmp_path, "t", "d"), "concurrent", session, result, lambda line: None)
    assert [arm for arm, _, _ in served] == ["sparse_off", "sparse_on", "sparse_recovery", "sparse_on",
                                            "sparse_recovery"]
    # Each recovery arm waits for the sends of the sparse-on arm of its own pair, nobody else does.
    assert served[2][1] is served[1][2] and served[4][1] is served[3][2]
    assert [b for arm, b, _ in served if arm != "sparse_recovery"] == [None, None, None]
    assert [p.first for p in result.repeats] == ["sparse_on", "sparse_on"]

    # A sequential session has no arrivals to take: the pairs alternate as before.
    served.clear()
    run_mod._serve_arms(config, ModelPair(tmp_path, "t", "d"), "agent", sessions.build("agent", config.shape, 1.0),
                        SessionResult("agent", "test"), lambda line: None)
    assert [arm for arm, _, _ in served][3:] == ["sparse_recovery", "sparse_on"]
    assert all(b is None for _, b, _ in served)

    from mlx_recovery_plugin.bench.server.cli import _config
    from mlx_recovery_plugin.cli import build_parser

    parse = build_parser().parse_args
    assert _config(parse(["bench", "server"]), tmp_path).arrivals == "own"
    assert _config(parse(["bench", "server", "--arrivals", "sparse-on"]), tmp_path).arrivals == "sparse-on"
    with pytest.raises(SystemExit):
        parse(["bench", "server", "--arrivals", "recovery"])


def test_one_schedule_serves_every_concurrent_pair_the_same_turns_and_reports_each_turns_median(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --one-schedule each later turn has one ratio per pair: a turn slow in one pair
    only (2x in pair 2) is read at its median; one slow in every pair (1.3x) decides. The
    arms list concurrent turns in the order they were sent, which differs between runs."""
    served: list[list[tuple[str, int, float, float]]] = []
    runs = iter(range(100))

    def fake_run_arm(config, pair, session, arm, root, progress, not_before=None):
        served.append([(s.conversation, s.turn, s.start_s, s.think_s) for s in session.steps])
        k = next(runs)
        run = ArmRun(arm)
        if arm == "sparse_recovery":
            slow_b = 2.0 if k == 4 else 1.0  # B's turn 2 slow in the second pair only
            turns = [("A", 1, 10.0), ("B", 1, 10.0), ("B", 2, 5.0 * slow_b), ("A", 2, 6.5)]  # A's turn 2: 1.3x
        else:
            turns = [("A", 1, 10.0), ("B", 1, 10.0), ("A", 2, 5.0), ("B", 2, 5.0)]
        for i, (conv, turn, t) in enumerate(turns):
            run.steps.append(StepRecord(i + 1, conv, turn, "", 9000 + i, 0, t, t, 0.0))
        return run

    monkeypatch.setattr(run_mod, "run_arm", fake_run_arm)
    from mlx_recovery_plugin.bench.server.cli import _config
    from mlx_recovery_plugin.cli import build_parser

    args = ["bench", "server", "--repeats", "3", "--one-schedule", "--arrivals", "sparse-on"]
    config = _config(build_parser().parse_args(args), tmp_path)
    config.shape = sessions.Shape(context_chars=400, turns=2)
    session = sessions.build("concurrent", config.shape, 30.0, 3)
    result = SessionResult("concurrent", session.description, concurrent=True)
    run_mod._serve_arms(config, ModelPair(tmp_path, "t", "d"), "concurrent", session, result, lambda line: None)

    assert all(s == served[0] for s in served)  # sparse off and every pair on the first schedule
    assert [p.seed for p in result.repeats] == [11, 11, 11]
    summary = repeats_summary(result.repeats)
    assert summary["worst_later_turn_median_vs_on"] == pytest.approx(1.3)
    assert summary["later_turn_medians"] == 2 and summary["later_turn_medians_above_1_1"] == 1
    assert "2 later turns, 1 with a median above 1.1x" in "\n".join(format_session(result))
    with pytest.raises(ValueError, match="--repeats 2"):
        _config(build_parser().parse_args(["bench", "server", "--one-schedule"]), tmp_path)


def test_the_pairs_committed_shares_are_reported_at_the_end_and_after_settling() -> None:
    from mlx_recovery_plugin.bench.server.repeats import RepeatPair, repeat_lines, repeats_summary

    pairs = []
    for end, settled in (((1000, 4000), (3500, 4000)), ((2000, 4000), (3000, 4200))):
        rec = _arm("sparse_recovery", [9.0, 5.0], None)
        rec.final_status = {"tokens_recovered": end[0], "tokens_run": end[1], "tokens_held": end[1] - end[0]}
        rec.settled_status = {"tokens_recovered": settled[0], "tokens_run": settled[1], "tokens_held": 0}
        rec.settle_s = 40.0
        pairs.append(RepeatPair(11, "sparse_on", _arm("sparse_on", [10.0, 5.0], None), rec))
    summary = repeats_summary(pairs)
    assert summary["committed_share"]["min"] == pytest.approx(0.25)
    assert summary["committed_share"]["max"] == pytest.approx(0.5)
    assert summary["settled_committed_share"]["min"] == pytest.approx(3000 / 4200, abs=1e-4)
    assert summary["pairs"][0]["settled_committed_share"] == pytest.approx(0.875)
    assert "committed / run over the pairs: at the end 0.25-0.50, 40 s after the last answer 0.71-0.88" in repeat_lines(pairs)


def test_sparse_on_against_itself_across_pairs_is_the_floor_a_recovery_turns_ratio_is_read_against() -> None:
    """Turn 2 drifts between the pairs (5 s, then 6 s) in both arms: sparse on against
    itself reads 1.2x at worst, and recovery no worse; recovery making turn 3 1.5x slower
    in every pair stands out above that floor."""
    from mlx_recovery_plugin.bench.server.repeats import RepeatPair, across_pairs, repeat_lines, repeats_summary

    def pairs(rec_turn_3: float) -> list[RepeatPair]:
        return [RepeatPair(11 + i, "sparse_on", _arm("sparse_on", [10.0, t2, 5.0], None),
                           _arm("sparse_recovery", [9.0, t2, rec_turn_3], None)) for i, t2 in enumerate((5.0, 6.0))]

    level = pairs(5.0)
    assert across_pairs(level, "sparse_on") == [[pytest.approx(5 / 6), 1.0], [pytest.approx(1.2), 1.0]]
    floor = repeats_summary(level)["across_pairs"]
    assert floor["sparse_on"] == {"worst_later_turn": {"median": 1.1, "min": 1.0, "max": 1.2, "n": 2},
                                  "later_turns": 4, "later_turns_above_1_1": 1}
    assert floor["sparse_recovery"] == floor["sparse_on"]  # recovery's turns are sparse on's here

    slower = repeats_summary(pairs(7.5))["across_pairs"]
    assert slower["sparse_on"] == floor["sparse_on"]
    assert slower["sparse_recovery"]["worst_later_turn"] == {"median": 1.5, "min": 1.5, "max": 1.5, "n": 2}
    assert slower["sparse_recovery"]["later_turns_above_1_1"] == 3
    line = next(x for x in repeat_lines(pairs(7.5)) if x.startswith("across pairs"))
    assert "sparse on against itself median 1.10x [1.00, 1.20], 1 of 4" in line
    assert "on + recovery median 1.50x [1.50, 1.50], 3 of 4" in line

    other_turns = level[:1] + [RepeatPair(12, "sparse_on", _arm("sparse_on", [10.0, 5.0], None),
                                          _arm("sparse_recovery", [9.0, 5.0], None))]
    assert across_pairs(other_turns, "sparse_on") is None
    assert repeats_summary(other_turns)["across_pairs"] == {"sparse_on": None, "sparse_recovery": None}
