"""The server bench's host choice: what each arm of rapid-mlx is started with (cheap: no
server starts), and that the omlx choice is what it was."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_recovery_plugin.bench.server.cli import _config
from mlx_recovery_plugin.bench.server.hosts import OMLX, RAPID
from mlx_recovery_plugin.bench.server.models import ModelPair
from mlx_recovery_plugin.bench.server.process import ServerSpec
from mlx_recovery_plugin.bench.server.run import BenchConfig, _server_spec


def spec_for(tmp_path: Path, arm: str, host=RAPID) -> ServerSpec:
    pair = ModelPair(tmp_path / "models", "target", "draft")
    config = BenchConfig(workdir=tmp_path, host=host)
    spec = _server_spec(config, pair, tmp_path / arm, arm)
    spec.command = [host.command]  # what would run; nothing is started
    return spec


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_rapid_arms_switch_pflash_on_the_uncached_basis_and_isolate_the_persisted_cache(tmp_path: Path) -> None:
    off = spec_for(tmp_path, "sparse_off")
    on = spec_for(tmp_path, "sparse_on")
    rec = spec_for(tmp_path, "sparse_recovery")
    argv = {arm: spec.argv(8000) for arm, spec in (("off", off), ("on", on), ("rec", rec))}
    assert [flag(a, "--pflash") for a in argv.values()] == ["off", "auto", "auto"]
    for a in argv.values():
        assert a[:3] == ["rapid-mlx", "serve", str(tmp_path / "models" / "target")]
        assert flag(a, "--pflash-threshold-basis") == "uncached"
        assert flag(a, "--pflash-threshold") == str(RAPID.pflash_threshold)
        assert flag(a, "--served-model-name") == "target"
        assert flag(a, "--pflash-min-keep-tokens") == "512"  # else a 9k prompt is never compressed
    homes = {spec.env["HOME"] for spec in (off, on, rec)}
    assert len(homes) == 3  # no arm reads another's ~/.cache/rapid-mlx
    saved = Path(rec.env["HOME"]) / ".cache" / "rapid-mlx" / "prefix_cache"
    saved.mkdir(parents=True)  # what rapid-mlx leaves at shutdown
    assert not any(Path(spec_for(tmp_path, "sparse_recovery").env["HOME"]).iterdir())  # a reused workdir starts empty
    assert all(spec.env["RAPID_MLX_TELEMETRY"] == "0" for spec in (off, on, rec))
    assert [spec.env["MLX_RECOVERY_ENABLE"] for spec in (off, on, rec)] == ["0", "0", "1"]
    assert "target" in json.loads(rec.env["MLX_RECOVERY_MODELS"])


def test_the_omlx_choice_is_unchanged(tmp_path: Path) -> None:
    argv = spec_for(tmp_path, "sparse_on", host=OMLX).argv(8000)
    assert argv[:3] == ["omlx", "serve", "--model-dir"] and "--pflash" not in argv
    assert "HOME" not in spec_for(tmp_path, "sparse_on", host=OMLX).env


def test_the_command_line_picks_the_host_and_its_threshold(tmp_path: Path) -> None:
    import argparse

    from mlx_recovery_plugin.bench.server.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["server", "--host", "rapid", "--pflash-threshold", "2048", "--quick"])
    config = _config(args, tmp_path)
    assert config.host.name == "rapid" and config.host.pflash_threshold == 2048
    assert _config(parser.parse_args(["server"]), tmp_path).host is OMLX


def _stream(usage: object) -> object:
    from types import SimpleNamespace

    chunks = [SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content="a"))], usage=None),
              SimpleNamespace(choices=[], usage=usage)]
    create = lambda **kw: iter(chunks)  # noqa: E731
    return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def test_rapid_mlx_leaving_out_a_zero_cached_figure_reads_as_zero_only_for_that_host() -> None:
    from types import SimpleNamespace

    import pytest

    from mlx_recovery_plugin.bench.server.client import MissingMeasurementError, send_turn

    usage = SimpleNamespace(prompt_tokens=9000, completion_tokens=2, prompt_tokens_details=None)
    assert RAPID.omits_zero_cached and not OMLX.omits_zero_cached
    assert send_turn(_stream(usage), "m", [], absent_cached_is_zero=True).cached_tokens == 0
    with pytest.raises(MissingMeasurementError):
        send_turn(_stream(usage), "m", [])
