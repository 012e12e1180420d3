"""``bench server --model NAME|PATH [--draft NAME|PATH]``: a trained model by name or any
mlx-lm directory is served where it lies (linked, not copied), refused before any work
when it cannot be (not fetched, no such directory, no chat template, options that
conflict), sized in its own tokens with its context said; and one short run on the real
rapid-mlx server with SmolLM2 by name (when rapid-mlx is installed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from mlx_recovery_plugin import cli
from mlx_recovery_plugin.bench.server import sessions
from mlx_recovery_plugin.bench.server.cli import _config, add_parser
from mlx_recovery_plugin.bench.server.hosts import RAPID
from mlx_recovery_plugin.bench.server.models import ModelDirError, link_models
from mlx_recovery_plugin.bench.server.run import (
    BenchConfig,
    _server_spec,
    fit_to_target,
    load_target_tokenizer,
    prompt_counter,
    size_notes,
)


class WorkStarted(Exception):
    """The bench began its run: a refusal came too late."""


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_args: object, **_kwargs: object) -> None:
        raise WorkStarted

    from mlx_recovery_plugin.bench.server import process
    from mlx_recovery_plugin.bench.server import run as server_run

    monkeypatch.setattr(server_run, "run_bench", started)
    monkeypatch.setattr(process, "host_command", lambda host: [host.command])  # as if installed


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["server", *argv])


def bench(*argv: str) -> int:
    return cli.main(["bench", "server", "--no-openblas", *argv])


def test_a_known_name_is_served_from_the_cache_under_its_directory_name(smollm2_dir: Path, tmp_path: Path) -> None:
    pair = _config(parse("--model", "smollm2"), tmp_path).pair
    assert pair is not None and pair.target_id == smollm2_dir.name == "smollm2-0.1.2-float32"
    assert pair.model_dir == tmp_path / "linked-models"
    assert (pair.target_path / "config.json").is_file() and (pair.target_path / "model.safetensors").is_file()
    assert pair.target_path.resolve() == smollm2_dir.resolve()  # the cache's weights, not a copy
    assert pair.draft_id == pair.target_id  # oMLX: the draft defaults to the model itself
    settings = json.loads((_server_spec(BenchConfig(tmp_path, pair=pair), pair, tmp_path / "on", "sparse_on")
                           .base_path / "model_settings.json").read_text())
    entry = settings["models"][pair.target_id]
    assert entry["specprefill_enabled"] and entry["specprefill_draft_model"] == str(pair.target_path)


def test_a_path_is_served_under_its_name_and_rapid_mlx_needs_no_draft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = _config(parse("--host", "rapid", "--model", str(tiny_llama_dir)), tmp_path)
    pair = config.pair
    assert pair is not None and pair.target_id == tiny_llama_dir.name and pair.draft_id == ""
    assert [p.name for p in pair.model_dir.iterdir()] == [tiny_llama_dir.name]
    spec = _server_spec(config, pair, tmp_path / "on", "sparse_on")
    spec.command = [RAPID.command]  # what would run; nothing is started
    argv = spec.argv(8000)
    assert argv[:3] == ["rapid-mlx", "serve", str(pair.target_path)]
    assert argv[argv.index("--served-model-name") + 1] == tiny_llama_dir.name


def test_a_draft_of_its_own_is_linked_beside_the_target(
    tiny_llama_dir: Path, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    pair = _config(parse("--model", str(tiny_llama_dir), "--draft", str(tiny_draft_dir)), tmp_path).pair
    assert pair is not None and pair.draft_id != pair.target_id
    assert pair.draft_path.resolve() == tiny_draft_dir.resolve()
    assert sorted(p.name for p in pair.model_dir.iterdir()) == sorted([pair.target_id, pair.draft_id])
    # A second run in the same work directory serves only what it was asked for.
    again = _config(parse("--model", str(tiny_llama_dir)), tmp_path).pair
    assert again is not None and [p.name for p in again.model_dir.iterdir()] == [again.target_id]


def test_the_omlx_family_discovers_the_linked_models_by_their_ids(
    tiny_llama_dir: Path, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    discovery = pytest.importorskip("omlx.model_discovery", reason="oMLX is not installed; CI installs it in .venv-omlx")
    pair = link_models(tmp_path / "models", tiny_llama_dir, tiny_draft_dir)
    found = discovery.discover_models(pair.model_dir)
    assert set(found) == {pair.target_id, pair.draft_id}


def test_two_directories_of_one_name_get_two_ids(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / tiny_llama_dir.name
    other.mkdir(parents=True)
    pair = link_models(tmp_path / "models", tiny_llama_dir, other)
    assert pair.draft_id == "draft-" + pair.target_id and pair.draft_path.resolve() == other.resolve()


def test_something_not_linked_by_the_bench_in_its_models_directory_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "models" / "stray").mkdir(parents=True)
    with pytest.raises(ModelDirError, match="not a link the bench made"):
        link_models(tmp_path / "models", tiny_llama_dir, None)


def test_a_name_not_fetched_is_refused_at_once_with_the_command_to_run(
    no_work: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    assert bench("--model", "smollm2") == 2
    assert "run `mlx-recovery models fetch smollm2`" in capsys.readouterr().err
    assert bench("--model", str(tmp_path), "--draft", "gemma3-270m") == 2
    assert "run `mlx-recovery models fetch gemma3-270m`" in capsys.readouterr().err


def test_a_missing_directory_is_refused_naming_the_known_models(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    assert bench("--model", str(missing)) == 2
    err = capsys.readouterr().err
    assert f"--model {missing}: no such directory" in err and "smollm2" in err


@pytest.mark.parametrize(("extra", "says"), [
    (["--model-dir", "."], "does not go with --model-dir"),
    (["--target", "512x8"], "does not go with --target"),
    (["--target-id", "t", "--draft-id", "d"], "does not go with --target-id, --draft-id"),
])
def test_model_with_another_way_to_choose_the_target_is_refused(
    no_work: None, tiny_llama_dir: Path, extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench("--model", str(tiny_llama_dir), *extra) == 2
    assert says in capsys.readouterr().err


def test_a_draft_without_a_model_or_on_rapid_mlx_is_refused(
    no_work: None, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench("--draft", str(tiny_llama_dir)) == 2
    assert "--draft goes with --model" in capsys.readouterr().err
    assert bench("--host", "rapid", "--model", str(tiny_llama_dir), "--draft", str(tiny_llama_dir)) == 2
    assert "--draft is not used with --host rapid" in capsys.readouterr().err


def test_a_model_without_a_chat_template_is_refused_before_the_run(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base-model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    assert bench("--model", str(base), "--workdir", str(tmp_path / "work")) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_good_model_options_reach_the_run(no_work: None, tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(WorkStarted):
        bench("--model", str(tiny_llama_dir), "--workdir", str(tmp_path))


def test_the_demo_takes_a_draft_by_name_too(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_recovery_plugin.demo import run as demo_run

    def started(*_args: object, **_kwargs: object) -> None:
        raise WorkStarted

    monkeypatch.setattr(demo_run, "run_demo", started)
    with pytest.raises(WorkStarted):  # the option check once said "--draft smollm2: no such directory"
        cli.main(["demo", "--no-openblas", "--model", "smollm2", "--draft", "smollm2"])


def test_the_named_model_sizes_the_session_in_its_tokens_and_says_when_it_is_beyond_its_context(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    def notes(*argv: str) -> tuple[sessions.TokenSizes, list[str]]:
        config = _config(parse("--model", "smollm2", "--sessions", "agent", *argv), tmp_path)
        assert config.pair is not None
        tokenizer = load_target_tokenizer(config.pair)
        config, fit = fit_to_target(config, tokenizer, lambda line: None)
        assert fit["prose_chars_per_token"] > 3  # BPE: several characters a token, not one
        sizes = sessions.token_sizes(sessions.agent(config.shape, 1.0), prompt_counter(tokenizer))
        return sizes, size_notes(config, config.pair, sizes)

    sizes, said = notes()  # the default 8,500-token context: beyond SmolLM2's 8,192
    assert sizes.first_turns[0] > 8192
    assert any("beyond the target's context (8,192)" in note for note in said), said
    sizes, said = notes("--context-tokens", "5200")
    assert sizes.longest < 8192 and said == []
    assert sizes.first_turns[0] == pytest.approx(5200 + 300 + 90, rel=0.05)


# -- the real server -------------------------------------------------------------------


def _rapid_ready() -> str | None:
    for module in ("rapid_mlx.server", "openai"):
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} is not installed ({exc}); CI installs rapid-mlx in .venv-rapid"
    return None


def test_smollm2_by_name_on_the_real_rapid_mlx_server_is_served_and_measured(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = _rapid_ready()
    if reason is not None:
        pytest.skip(reason)
    from mlx_recovery_plugin.bench.server import hosts, process

    # PFlash keeps at least its fixed budgets (keep, sink + tail): smaller ones let a
    # ~1,900-token first turn (SmolLM2's dense prefill is slow here) be compressed.
    small = ("--pflash-min-keep-tokens", "128", "--pflash-tail-tokens", "128", "--pflash-sink-tokens", "16")
    monkeypatch.setitem(hosts.HOSTS, "rapid", dataclasses.replace(RAPID, pflash_flags=small))
    # A short work directory: the control socket's path under it must fit a socket's 108 bytes.
    work = Path(tempfile.mkdtemp(prefix="mlx-rb-"))
    out = work / "bench.json"
    code = bench("--host", "rapid", "--model", "smollm2", "--quick", "--turns", "2", "--think-time", "3",
                 "--context-tokens", "1500", "--pflash-threshold", "1024", "--workdir", str(work),
                 "--json", str(out))
    printed = capsys.readouterr()
    assert code == 0, f"server logs under {work}/runs\n" + printed.err[-4000:]
    report = json.loads(out.read_text())
    shutil.rmtree(work, ignore_errors=True)  # kept when the run failed, for its logs
    assert "target smollm2-0.1.2-float32" in printed.out
    assert report["target"] == "smollm2-0.1.2-float32" and "rapid-mlx" in report["host"]
    assert report["token_fit"]["prose_chars_per_token"] > 3  # sized in SmolLM2's own tokens
    (agent,) = report["sessions"]
    for arm in ("sparse_off", "sparse_on", "sparse_recovery"):
        steps = agent["arms"][arm]["steps"]
        # At most the chat template's opening is cached before the first turn (from the warm-up).
        assert len(steps) == 2 and steps[0]["prompt_tokens"] > 1024 and steps[0]["cached_tokens"] < 16
        assert steps[1]["prompt_tokens"] > steps[0]["prompt_tokens"]
    assert agent["arms"]["sparse_off"]["steps"][1]["cached_tokens"] > 0  # its prefix cache served turn 2
    assert agent["arms"]["sparse_on"]["steps"][0]["sparse"] is True  # PFlash compressed the first turn
    assert agent["arms"]["sparse_recovery"]["steps"][0]["status"] is not None  # the plugin answered
    assert not process._live


def _sampled_tokens(model_path: Path, prompts: int = 24, seed: int = 3) -> list[int]:
    """The token each of ``prompts`` random prompts samples first, at temperature 1."""
    import mlx.core as mx

    from mlx_recovery_plugin.testing.contract import contract_tokens
    from mlx_recovery_plugin.testing.tiny_model import load_tiny_model

    model, _ = load_tiny_model(model_path)
    mx.random.seed(seed)
    picked = []
    for i in range(prompts):
        logits = model(mx.array([list(contract_tokens(40, seed=100 + i))]))[:, -1, :]
        picked.append(int(mx.random.categorical(logits).item()))
    return picked


def test_the_benchs_target_streams_every_token_it_picks_as_it_comes(tmp_path: Path) -> None:
    """A client times the first streamed text: a lone byte of a multi-byte character is
    held back by the server until the next token, so the bench would time the second
    token; a padding id streams nothing at all. The target it writes never picks either
    (the same random model without the change does, about half the time); the draft is
    left as it is."""
    from mlx_recovery_plugin.bench.server.models import write_models
    from mlx_recovery_plugin.testing.tiny_model import (
        TinyModelSpec,
        load_tiny_model,
        no_text_alone,
        write_tiny_model,
    )

    spec = TinyModelSpec(arch="llama", seed=4)
    pair = write_models(tmp_path / "models", spec, TinyModelSpec(arch="llama", num_layers=1, seed=7))
    assert pair.target_id.endswith("-wc")
    plain = write_tiny_model(tmp_path / "plain", spec)
    silent = [t for t in _sampled_tokens(plain) if no_text_alone(t)]
    assert len(silent) >= 4, "the test's prompts no longer show the problem"
    picked = _sampled_tokens(pair.target_path)
    assert [t for t in picked if no_text_alone(t)] == []
    _, tokenizer = load_tiny_model(pair.target_path)
    for token in set(picked):
        text = tokenizer.decode([token])
        assert text and "\ufffd" not in text, token
