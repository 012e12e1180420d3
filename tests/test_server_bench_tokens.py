"""The server bench's sessions in the target's own tokens, and a run where the sparse
route never applied (cheap: fake tokenizers, hand-made records, no server)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mlx_recovery_plugin.bench.server import sessions
from mlx_recovery_plugin.bench.server.cli import _config, add_parser
from mlx_recovery_plugin.bench.server.hosts import OMLX, RAPID
from mlx_recovery_plugin.bench.server.models import ModelPair
from mlx_recovery_plugin.bench.server.report import (
    ArmRun,
    BenchReport,
    SessionResult,
    StepRecord,
    format_session,
)
from mlx_recovery_plugin.bench.server.run import BenchConfig, size_notes, sparse_lines


def byte_encode(text: str) -> list[int]:
    return list(text.encode())


def four_chars_a_token(text: str) -> list[int]:
    return list(range((len(text) + 3) // 4))


def count_with(encode):
    """A chat template of one marker token per message plus the generation prompt."""
    return lambda messages: sum(len(encode(m["content"])) + 1 for m in messages) + 1


def test_a_byte_level_tokenizer_keeps_the_shape_as_it_was() -> None:
    shape = sessions.Shape()
    fitted, fit = sessions.fit_shape(shape, byte_encode)
    assert fit.byte_level and fitted == shape


def test_a_bpe_like_tokenizer_gets_the_intended_token_counts() -> None:
    shape = sessions.Shape(context_chars=6000, turns=3)
    fitted, fit = sessions.fit_shape(shape, four_chars_a_token)
    assert not fit.byte_level and fitted.context_chars > 3.5 * shape.context_chars
    sizes = sessions.token_sizes(sessions.agent(fitted, 1.0), count_with(four_chars_a_token))
    first = shape.system_chars + shape.context_chars + shape.question_chars
    appended = shape.reply_chars + shape.tool_chars + shape.question_chars
    assert sizes.first_turns[0] == pytest.approx(first, rel=0.02)
    assert sizes.appended[0] == 0
    assert all(a == pytest.approx(appended, rel=0.03) for a in sizes.appended[1:])
    assert "first turn" in sizes.describe() and f"{sizes.longest:,}" in sizes.describe()


def test_a_fork_counts_against_its_conversation_and_a_second_conversation_starts_at_zero() -> None:
    shape = sessions.Shape(context_chars=500, turns=3)
    fork = sessions.token_sizes(sessions.fork(shape, 1.0), count_with(byte_encode))
    assert len(fork.first_turns) == 1 and fork.appended[-1] == 0  # an edited question of the same size
    both = sessions.token_sizes(sessions.interleaved(shape, 1.0), count_with(byte_encode))
    assert len(both.first_turns) == 2 and both.appended[:2] == (0, 0)


def test_the_command_line_sets_the_context_in_tokens_and_needs_no_draft_for_rapid(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["server", "--host", "rapid", "--model-dir", str(tmp_path), "--target-id", "smol",
                              "--context-tokens", "5200", "--max-tokens", "8", "--tool-tokens", "2500"])
    config = _config(args, tmp_path)
    assert config.shape.context_chars == 5200 and config.max_tokens == 8
    grown = sessions.token_sizes(sessions.agent(config.shape, 1.0), count_with(byte_encode)).appended
    assert all(2500 < n < 2800 for n in grown[1:]), grown  # the tool output, a reply and a question
    assert config.pair == ModelPair(tmp_path, "smol", "")
    with pytest.raises(ValueError, match="--draft-id"):
        _config(parser.parse_args(["server", "--model-dir", str(tmp_path), "--target-id", "smol"]), tmp_path)


def test_sizes_that_miss_the_context_or_the_pflash_threshold_are_named(tmp_path: Path) -> None:
    target = tmp_path / "smol"
    target.mkdir()
    (target / "config.json").write_text('{"max_position_embeddings": 8192}')
    pair = ModelPair(tmp_path, "smol", "")
    rapid = BenchConfig(workdir=tmp_path, host=RAPID)
    good = sessions.TokenSizes(prompts=(5600, 6200, 8100), appended=(0, 600, 600), first_turns=(5600,))
    assert size_notes(rapid, pair, good) == []
    short = sessions.TokenSizes(prompts=(1900, 2050, 9000), appended=(0, 150, 6950), first_turns=(1900,))
    notes = " | ".join(size_notes(rapid, pair, short))
    assert "beyond the target's context (8192)" in notes.replace(",", "")
    assert "not above the PFlash threshold" in notes and "reaches the PFlash threshold" in notes
    assert len(size_notes(BenchConfig(workdir=tmp_path, host=OMLX), pair, short)) == 1  # no PFlash there


def test_the_sparse_route_is_read_from_each_hosts_log_lines() -> None:
    rapid_log = (
        "INFO [pflash] request=abc123def456 compressed 5642 -> 1128 tokens ratio=0.200 scoring_ms=3.1\n"
        "DEBUG [pflash] request=fff123def456 skipped reason=below_threshold tokens=600\n"
    )
    assert sparse_lines(RAPID, rapid_log) == 1
    assert sparse_lines(OMLX, "SpecPrefill: sparse prefill 1800/9000 conv tokens in 2.0s\n") == 1
    assert sparse_lines(OMLX, rapid_log) == 0


def _arm(arm: str, rows: list[tuple[int, int, float, bool]], answers: list[str] | None = None) -> ArmRun:
    run = ArmRun(arm)
    for i, (prompt, cached, ttft, sparse) in enumerate(rows):
        run.steps.append(StepRecord(
            i + 1, "A", i + 1, "", prompt, cached, ttft, ttft, 0.0,
            {"tokens_recovered": 0, "tokens_run": 0} if arm == "sparse_recovery" else None,
            sparse=sparse, answer=(answers or ["x"] * len(rows))[i],
        ))
    return run


def _result(on_sparse: bool) -> SessionResult:
    result = SessionResult("agent", "test", sparse_hint="PFlash applies above 4,096 uncached tokens")
    result.arms = {
        "sparse_off": _arm("sparse_off", [(1900, 0, 4.0, False), (2050, 1900, 0.5, False)], ["a", "b"]),
        "sparse_on": _arm("sparse_on", [(1900, 0, 4.1, on_sparse), (2050, 1900, 0.5, False)], ["a", "c"]),
        "sparse_recovery": _arm("sparse_recovery", [(1900, 0, 4.0, on_sparse), (2050, 1900, 0.5, False)],
                                ["a", "b"]),
    }
    return result


def test_a_run_where_the_sparse_route_never_applied_says_so_and_prints_no_ratio() -> None:
    result = _result(on_sparse=False)
    text = "\n".join(format_session(result))
    assert "THE SPARSE ROUTE NEVER APPLIED" in text and "PFlash applies above 4,096" in text
    assert "recovery minus" not in text and "worst later turn" not in text
    assert "served sparse (server log): sparse off 0/2, sparse on 0/2, sparse on + recovery 0/2" in text
    summary = BenchReport("t", "d", "rapid", "openblas", 50.0, 30.0, 1.0, 2, "auto", [result]).to_json()["summary"]
    assert summary["agent"]["sparse_route_applied"] is False
    assert summary["agent"]["sparse_steps"]["sparse_on"] == 0


def test_a_run_where_the_sparse_route_applied_prints_its_ratios_and_compares_answers() -> None:
    result = _result(on_sparse=True)
    text = "\n".join(format_session(result))
    assert "NEVER APPLIED" not in text and "recovery minus" in text
    assert "answer equals sparse off's: sparse on 0/1, sparse on + recovery 1/1" in text.lower()
    assert result.sparse_route_applied() is True


def test_a_log_that_cannot_tell_leaves_the_route_unknown_and_the_ratios_in() -> None:
    result = _result(on_sparse=True)
    for step in result.arms["sparse_on"].steps:
        step.sparse = None
    assert result.sparse_route_applied() is None and result.sparse_note() == ""
    assert "served sparse: unknown" in "\n".join(format_session(result))



class _QuietLog:
    def log_text(self) -> str:
        return ""


def _serve_with_a_watched_load(monkeypatch: pytest.MonkeyPatch, loads: list, fail_at: int | None = None):
    """Serve a 3-turn agent session with --load-first-turn on a fake client (a real
    one-process load); ``loads`` gets the load. Returns whether it ran at each turn's
    send, and the arm's records."""
    from mlx_recovery_plugin.bench.policy.load import CompetingLoad
    from mlx_recovery_plugin.bench.server import run as run_mod
    from mlx_recovery_plugin.bench.server.client import TurnMeasure

    running_at_send: list[bool] = []

    def one_process_load() -> CompetingLoad:
        loads.append(CompetingLoad(1))
        return loads[-1]

    def send_turn(client, model, messages, max_tokens=2, *, absent_cached_is_zero=False):
        running_at_send.append(loads[0].running and all(c.poll() is None for c in loads[0]._children))
        if fail_at is not None and len(running_at_send) == fail_at:
            raise RuntimeError("the server went away")
        return TurnMeasure(prompt_tokens=100, cached_tokens=0, ttft_s=0.1, total_s=0.1, completion_tokens=1)

    monkeypatch.setattr(run_mod, "CompetingLoad", one_process_load)
    monkeypatch.setattr(run_mod, "send_turn", send_turn)
    config = BenchConfig(workdir=Path("."), load_first_turn=True, idle_wait_s=0.0)
    session = sessions.agent(sessions.Shape(context_chars=50, turns=3), think_s=0.05)
    run = ArmRun("sparse_off")
    pair = ModelPair(Path("."), "target", "draft")
    run_mod._serve_in_order(config, pair, session, "sparse_off", _QuietLog(), None, lambda line: None, "t", run)
    return running_at_send, run


@pytest.fixture
def watched_loads():
    """The loads a test starts; stopped after it whatever it found, so a failing test
    leaves no busy loop behind to slow the tests after it."""
    loads: list = []
    yield loads
    for load in loads:
        load.stop()


def test_the_first_turn_load_runs_through_the_first_turn_only_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch, watched_loads: list,
) -> None:
    loads = watched_loads
    running, run = _serve_with_a_watched_load(monkeypatch, loads)
    assert running == [True, False, False]
    assert [step.loaded for step in run.steps] == [True, False, False]
    # Sparse off waits only idle_wait_s (0 here) between turns, but the loaded gap in full
    # (each gap as measured: the wait and the bench's own work before the next send).
    idle = [step.idle_after_s for step in run.steps]
    assert idle[0] >= 0.05 and idle[1] < idle[0] and idle[2] == 0.0
    assert len(loads) == 1 and not loads[0].running


def test_the_first_turn_load_is_stopped_when_a_turn_fails(monkeypatch: pytest.MonkeyPatch, watched_loads: list) -> None:
    loads = watched_loads
    with pytest.raises(RuntimeError, match="went away"):
        _serve_with_a_watched_load(monkeypatch, loads, fail_at=1)
    assert len(loads) == 1 and not loads[0].running


def test_the_command_line_loads_the_first_turn_only_when_asked(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert _config(parser.parse_args(["server", "--load-first-turn"]), tmp_path).load_first_turn
    assert not _config(parser.parse_args(["server"]), tmp_path).load_first_turn


def test_work_held_back_at_the_end_is_reported_apart_from_what_was_committed() -> None:
    result = _result(on_sparse=True)
    result.arms["sparse_recovery"].steps[-1].status = {"tokens_recovered": 1024, "tokens_run": 4096,
                                                        "tokens_held": 2048}
    assert result.committed_share() == pytest.approx(0.25)
    assert result.held_share() == pytest.approx(0.5)
    text = "\n".join(format_session(result))
    assert "committed / run 0.25" in text and "held at the end / run 0.50" in text
    result.arms["sparse_recovery"].steps[-1].status = {"tokens_recovered": 1024, "tokens_run": 4096}
    assert result.held_share() is None  # an older plugin did not say


def test_settling_reads_the_status_again_after_the_idle_time_and_reports_what_was_committed_by_then() -> None:
    """``--settle``: work held at the session's end that the next think time commits is
    told apart from work still held then; the end's figures stay as they were."""
    from mlx_recovery_plugin.bench.server.run import settle

    result = _result(on_sparse=True)
    rec = result.arms["sparse_recovery"]
    rec.steps[-1].status = {"tokens_recovered": 1024, "tokens_run": 4096, "tokens_held": 3072}
    statuses = [{"process": {"tokens_recovered": 3840, "tokens_run": 4352, "tokens_held": 0}}]
    slept: list[float] = []
    settle(rec, statuses.pop, 40.0, slept.append, lambda line: None, "t")

    assert slept == [40.0] and not statuses  # waited once, then read once
    assert result.committed_share() == pytest.approx(0.25)  # the end, as before
    assert result.committed_share(settled=True) == pytest.approx(3840 / 4352)
    assert result.held_share(settled=True) == 0.0
    text = "\n".join(format_session(result))
    assert "committed / run 0.25" in text and "40 s after the last answer: committed / run 0.88, held / run 0.00" in text
    summary = BenchReport("t", "d", "omlx", "openblas", 50.0, 30.0, 1.0, 2, "auto", [result]).to_json()["summary"]
    assert summary["agent"]["settled_committed_share"] == pytest.approx(3840 / 4352)
    assert summary["agent"]["settle_s"] == 40.0


def test_without_settling_there_is_no_second_reading() -> None:
    result = _result(on_sparse=True)
    result.arms["sparse_recovery"].steps[-1].status = {"tokens_recovered": 1024, "tokens_run": 4096,
                                                        "tokens_held": 3072}
    assert result.committed_share(settled=True) is None
    assert "after the last answer" not in "\n".join(format_session(result))


def test_the_command_line_settles_only_when_asked_and_refuses_a_negative_time(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert _config(parser.parse_args(["server", "--settle", "40"]), tmp_path).settle_s == 40.0
    assert _config(parser.parse_args(["server"]), tmp_path).settle_s == 0.0
    with pytest.raises(ValueError, match="--settle"):
        _config(parser.parse_args(["server", "--settle", "-1"]), tmp_path)
