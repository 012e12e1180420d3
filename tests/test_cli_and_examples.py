"""The command line's config view, and the host-author example run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_recovery_plugin.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("MLX_RECOVERY_"):
            monkeypatch.delenv(name)


def test_config_prints_each_value_with_its_source(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", "7.5")
    assert main(["config", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["MLX_RECOVERY_BUDGET_PCT"] == {"value": 7.5, "source": "environment"}
    assert shown["MLX_RECOVERY_IDLE_STEPS"] == {"value": 2, "source": "default"}


def test_config_with_a_bad_value_exits_2_naming_the_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLX_RECOVERY_IDLE_STEPS", "0")
    assert main(["config"]) == 2
    assert "MLX_RECOVERY_IDLE_STEPS" in capsys.readouterr().err


def test_host_wiring_example_finds_the_plugins_through_entry_points_and_recovers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MLX_RECOVERY_")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "host_wiring.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "plugins loaded: ['adopter', 'recovery'] failed: {}" in done.stdout
    assert "prefix now restorable: 384 of 400 tokens" in done.stdout


def test_a_broken_subcommand_module_is_an_error_not_a_missing_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_recovery_plugin import cli

    monkeypatch.setattr(cli, "BENCH_MODULES", (*cli.BENCH_MODULES, "mlx_recovery_plugin.bench.no_such_bench"))
    with pytest.raises(ModuleNotFoundError, match="no_such_bench"):
        cli.build_parser()


def test_a_missing_optional_dependency_costs_only_its_subcommand(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from mlx_recovery_plugin import cli

    module = tmp_path / "needs_missing_dep.py"
    module.write_text("import some_package_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "BENCH_MODULES", (*cli.BENCH_MODULES, "needs_missing_dep"))
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "adopter"]).suite == "adopter", "the other benches stay"


class _Reexec(Exception):
    pass


@pytest.mark.parametrize(
    "argv",
    [["demo"], ["bench", "server"], ["lab", "runner"], ["lab", "budget"], ["lab", "interference"],
     ["lab", "efficiency"], ["lab", "faults"]],
)
def test_the_demo_and_every_model_bench_re_run_under_openblas_before_any_work(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One convention: each goes through openblas.maybe_reexec first (a bench that called the
    old form crashed only when run)."""
    from mlx_recovery_plugin.bench import openblas

    def reexec(command: object = None, *, mode: object = None) -> None:  # the real signature
        raise _Reexec(argv)

    monkeypatch.setattr(openblas, "reexec_with_openblas", reexec)
    # The option check comes first (tests/test_cli_options.py); a server that is not
    # installed here would stop `bench server` there.
    from mlx_recovery_plugin.bench.server import process

    monkeypatch.setattr(process, "host_command", lambda host: [host.command])
    from lab.cli import main as lab_main

    run = (lambda: lab_main(argv[1:])) if argv[0] == "lab" else (lambda: main(argv))
    try:
        with pytest.raises(_Reexec):
            run()
    except SystemExit as exc:  # a subcommand missing in this environment
        pytest.skip(f"{argv} is not available here: {exc}")
