"""The three-arm demo on the mock host, at toy size: the arms see the same prompts, the
sparse route alone leaves nothing reusable, and recovery brings reuse back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlx_recovery_plugin.cli import main
from mlx_recovery_plugin.demo.arms import ServeConfig
from mlx_recovery_plugin.demo.report import ARMS, format_table
from mlx_recovery_plugin.demo.run import DemoConfig, run_demo
from mlx_recovery_plugin.demo.session import SessionSpec, build_session
from mlx_recovery_plugin.testing.tiny_model import BENCH_TARGET, TinyModelSpec

TOY_SESSION = SessionSpec(system_tokens=700, turns=3, tool_tokens=150, question_tokens=30, reply_tokens=30)
TOY_SERVE = ServeConfig(model_id="toy", block_size=64, prefill_step=128, sparse_threshold=128)


@pytest.fixture
def toy_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DemoConfig:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return DemoConfig(
        session=TOY_SESSION,
        serve=TOY_SERVE,
        target=TinyModelSpec(seed=31),
        draft=TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=32),
    )


def test_session_only_appends_and_every_turn_is_longer() -> None:
    turns = build_session(SessionSpec(turns=5), lambda text: list(text.encode()))
    for before, after in zip(turns, turns[1:]):
        assert after.prompt[: len(before.prompt)] == before.prompt
        assert after.appended == len(after.prompt) - len(before.prompt) > 0


def test_default_session_and_threshold_follow_the_real_server() -> None:
    """An agent's session as oMLX sees it: the first turn alone is over the 8,192-token
    sparse threshold, each later turn appends ~600 tokens (reply, tool output, question)."""
    assert ServeConfig(model_id="m").sparse_threshold == 8192
    turns = build_session(SessionSpec(), lambda text: list(text.encode()))
    assert 8192 < len(turns[0].prompt) < 8700
    assert all(550 <= t.appended <= 650 for t in turns[1:])
    assert DemoConfig().target == BENCH_TARGET and DemoConfig().serve.model_id == BENCH_TARGET.label


def test_recovery_arm_restores_what_sparse_route_alone_never_keeps(toy_config: DemoConfig) -> None:
    report = run_demo(toy_config)
    (run,) = report.repeats
    off, on, rec = (run[arm] for arm in ARMS)
    assert [t.prompt_tokens for t in off.turns] == [t.prompt_tokens for t in on.turns] == [
        t.prompt_tokens for t in rec.turns
    ]
    assert all(t.route == "sparse" for t in on.turns)
    assert all(t.cached_tokens == 0 for t in on.turns)
    assert on.turns[-1].debt_tokens == on.turns[-2].prompt_tokens
    block = TOY_SERVE.block_size
    for t_off, t_rec in zip(off.turns[1:], rec.turns[1:]):
        assert t_off.cached_tokens > 0
        assert abs(t_off.cached_tokens - t_rec.cached_tokens) <= block
        assert t_rec.debt_tokens < block
    assert rec.recovered_tokens >= rec.turns[-1].cached_tokens - block
    table = format_table(report)
    assert "sparse on + recovery / sparse off" in table and "NEVER APPLIED" not in table
    assert report.balance is not None and report.balance["context"] == rec.turns[-1].prompt_tokens
    assert report.balance_line.startswith("cost balance: a token at") and report.balance_line in table


def test_demo_command_writes_json_and_plot(toy_config: DemoConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    import mlx_recovery_plugin.demo.run as run_module

    monkeypatch.setattr(run_module, "DemoConfig", lambda **kw: toy_config)
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    assert main(["demo", "--no-openblas", "--turns", "3", "--json", str(out_json), "--plot", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    assert set(data["repeats"][0]) == set(ARMS)
    assert data["ratios"]["sparse_recovery/sparse_off"]["median"] > 0
    assert data["balance"]["ratio"] > 0 and data["balance_line"].startswith("cost balance:")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()
    assert "cumulative foreground" in printed.out
    assert "turn 3" in printed.err  # progress went to stderr while it ran


def test_demo_on_the_real_omlx_scheduler_reports_the_same_shape(toy_config: DemoConfig) -> None:
    pytest.importorskip("omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it")
    from mlx_recovery_plugin.demo.omlx import run_omlx_demo

    report = run_omlx_demo(toy_config)
    (run,) = report.repeats
    assert set(run) == set(ARMS) and report.host == "omlx"
    assert all(t.cached_tokens == 0 for t in run["sparse_on"].turns)
    assert run["sparse_recovery"].turns[-1].cached_tokens > 0
    assert "sparse on + recovery / sparse on" in format_table(report)


def test_table_shows_per_turn_medians_over_repeats() -> None:
    from mlx_recovery_plugin.demo.report import ArmResult, DemoReport, TurnResult

    report = DemoReport("m", "mock", "blas", 64, 128, 1.0, 50.0)
    for cached, ttft in ((128, 1.0), (64, 3.0), (128, 2.0)):
        report.repeats.append(
            {arm: ArmResult(arm, [TurnResult(0, 200, cached, ttft, 200 - cached, "sparse")]) for arm in ARMS}
        )
    row = report.median_turn("sparse_recovery", 0)
    assert (row.cached_tokens, row.ttft_s, row.debt_tokens) == (128, 2.0, 72)
    assert report.ratio("sparse_recovery", "sparse_off") == (1.0, 1.0, 1.0)


def test_session_is_sized_in_the_models_tokens_with_its_chat_template(smollm2_dir: Path) -> None:
    """With SmolLM2's BPE tokenizer (several characters a token) the first turn still
    crosses the real server's 8,192-token threshold, and the markup is its own template's."""
    from mlx_lm.utils import load_tokenizer

    from mlx_recovery_plugin.demo.run import session_turns

    tokenizer = load_tokenizer(smollm2_dir)
    turns = session_turns(SessionSpec(), tokenizer)
    assert 8192 < len(turns[0].prompt) < 8600
    assert all(600 <= t.appended <= 680 for t in turns[1:])
    for before, after in zip(turns, turns[1:]):
        assert after.prompt[: len(before.prompt)] == before.prompt
    text = tokenizer.decode(list(turns[1].prompt))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>assistant\n") == 2 and "<|im_start|>tool\n" in text


def test_report_says_plainly_when_the_sparse_route_never_applied(toy_config: DemoConfig) -> None:
    import dataclasses

    config = dataclasses.replace(toy_config, serve=dataclasses.replace(TOY_SERVE, sparse_threshold=100_000))
    report = run_demo(config)
    assert report.sparse_turns("sparse_on") == 0 and not report.sparse_route_applied
    table = format_table(report)
    assert "THE SPARSE ROUTE NEVER APPLIED" in table and "threshold (100,000 tokens" in table
    assert report.to_json()["sparse_route_applied"] is False


def test_demo_by_name_not_fetched_says_which_command_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["demo", "--no-openblas", "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "model 'smollm2' is not fetched: run `mlx-recovery models fetch smollm2`" in err


def test_recall_session_asks_about_facts_its_first_turn_holds() -> None:
    from mlx_recovery_plugin.demo.recall import RecallSpec, build_recall_session

    turns = build_recall_session(RecallSpec(system_tokens=2000, turns=5), lambda text: list(text.encode()))
    first = bytes(turns[0].turn.prompt).decode()
    assert 2000 <= len(turns[0].turn.prompt) < 2200
    for before, after in zip(turns, turns[1:]):
        assert after.turn.prompt[: len(before.turn.prompt)] == before.turn.prompt
        item = after.question.removeprefix("In which room is the ").removesuffix(" kept?")
        assert f"The {item} is kept in room {after.expected}." in first
    assert len({t.expected for t in turns[1:]}) == 4  # four different facts asked about


def test_answers_run_shows_each_arms_answers_and_recovery_gives_the_dense_one_back(toy_config: DemoConfig) -> None:
    import dataclasses

    from mlx_recovery_plugin.demo.answers import format_answers, shares

    config = dataclasses.replace(toy_config, answers=True, serve=dataclasses.replace(TOY_SERVE, max_tokens=6))
    report = run_demo(config)
    (run,) = report.repeats
    assert len(report.expected) == 3 and report.expected[0] == "" and all(report.expected[1:])
    assert all(t.route == "sparse" for t in run["sparse_on"].turns)
    assert all(len(t.output_tokens) == 6 and t.answer for arm in ARMS for t in run[arm].turns)
    got = shares(report)
    assert (got["sparse_off"].same, got["sparse_off"].of) == (2, 2)
    rec = got["sparse_recovery"]
    assert rec.restored_of == 2 and rec.restored_same == 2  # restored prefix: the dense answer
    assert [t.output_tokens for t in run["sparse_recovery"].turns[1:]] == [t.output_tokens for t in run["sparse_off"].turns[1:]]
    text = format_answers(report)
    assert re.search(r"later turns, sparse off +: dense answer 2/2 \(100 %\)", text)
    assert "where a prefix was restored 2/2 (100 %)" in text
    assert report.to_json()["answers"]["shares"]["sparse_recovery"]["restored_dense_share"] == 1.0


def test_a_session_longer_than_the_models_context_is_named() -> None:
    from types import SimpleNamespace

    from mlx_recovery_plugin.demo.run import context_note

    turns = build_session(TOY_SESSION, lambda text: list(text.encode()))
    longest = len(turns[-1].prompt)
    assert context_note(SimpleNamespace(args=SimpleNamespace(max_position_embeddings=longest)), turns) == ""
    note = context_note(SimpleNamespace(args=SimpleNamespace(max_position_embeddings=512)), turns)
    assert note.startswith(f"note: the longest prompt ({longest:,} tokens) is beyond the model's context (512)")


def test_chat_format_wraps_tool_output_as_user_where_the_template_has_no_tool_role(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    from mlx_recovery_plugin.demo.session import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    assert ChatFormat.of(tokenizer) == ChatFormat.plain()  # the tiny template is the plain one
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] }}[end]{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = ChatFormat.of(tokenizer)
    assert chat.wrap["user"] == ("[user]", "[end]") and chat.wrap["tool"] == chat.wrap["user"]
    assert chat.generation == "[assistant]"
