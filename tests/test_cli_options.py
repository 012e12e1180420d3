"""A command checks what its options need before it starts its work (issue 22, 14)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlx_recovery_plugin import cli


class WorkStarted(Exception):
    """The command began its run: the option check came too late."""


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_args: object, **_kwargs: object) -> None:
        raise WorkStarted

    from mlx_recovery_plugin.bench import adopter, adopter_mlx_lm
    from mlx_recovery_plugin.bench.server import run as server_run
    from mlx_recovery_plugin.demo import run as demo_run

    monkeypatch.setattr(server_run, "run_bench", started)
    monkeypatch.setattr(demo_run, "run_demo", started)
    monkeypatch.setattr(adopter, "run_adopter_bench", started)
    monkeypatch.setattr(adopter_mlx_lm, "run_mlx_lm_bench", started)
    monkeypatch.setattr("mlx_recovery_plugin.bench.openblas.reexec_with_openblas", lambda: None)


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails


def test_bench_server_plot_without_matplotlib_fails_at_once_with_the_message(
    no_work: None, no_matplotlib: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["bench", "server", "--quick", "--no-openblas", "--plot", str(tmp_path / "p.png")])
    assert code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_demo_plot_without_matplotlib_fails_at_once(
    no_work: None, no_matplotlib: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", "--quick", "--no-openblas", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_bench_adopter_plot_without_matplotlib_fails_at_once(
    no_work: None, no_matplotlib: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "adopter", "--host", "mlx_lm", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_bench_adopter_plot_into_a_missing_directory_is_refused_before_the_run(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "p.png"
    assert cli.main(["bench", "adopter", "--host", "mlx_lm", "--plot", str(out)]) == 2
    assert f"--plot {out}: directory" in capsys.readouterr().err


def test_bench_adopter_plot_and_long_run_need_the_mlx_lm_host(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "adopter", "--plot", str(tmp_path / "p.png"), "--long-run", "40"]) == 2
    assert "--plot and --long-run need --host mlx_lm" in capsys.readouterr().err
    with pytest.raises(WorkStarted):  # without them the mock bench runs as before
        cli.main(["bench", "adopter"])


def test_a_model_directory_that_does_not_exist_is_refused_before_the_run(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    assert cli.main(["demo", "--no-openblas", "--model", str(missing)]) == 2
    assert f"--model {missing}: no such directory" in capsys.readouterr().err


def test_an_output_file_in_a_missing_directory_is_refused_before_the_run(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "report.json"
    assert cli.main(["demo", "--quick", "--no-openblas", "--json", str(out)]) == 2
    assert "--json" in capsys.readouterr().err


def test_the_adopter_benchs_out_file_in_a_missing_directory_is_refused_before_the_run(
    no_work: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "adopter.json"
    assert cli.main(["bench", "adopter", "--host", "mlx_lm", "--no-openblas", "--out", str(out)]) == 2
    assert f"--out {out}: directory" in capsys.readouterr().err


def test_the_adopter_bench_on_mlx_lm_runs_on_openblas_unless_told_not_to(
    no_work: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlx_recovery_plugin.bench import adopter_mlx_lm

    reexecs: list[bool] = []
    monkeypatch.setattr("mlx_recovery_plugin.bench.openblas.reexec_with_openblas", lambda: reexecs.append(True))
    monkeypatch.setattr(adopter_mlx_lm, "command", lambda args: 0)
    assert cli.main(["bench", "adopter", "--host", "mlx_lm"]) == 0
    assert cli.main(["bench", "adopter", "--host", "mlx_lm", "--no-openblas"]) == 0
    assert reexecs == [True]


def test_a_server_bench_host_that_is_not_installed_is_refused_before_the_run(
    no_work: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlx_recovery_plugin.bench.server import process

    def not_installed(host: object) -> list[str]:
        raise process.ServerStartError("no `rapid-mlx` command: install rapid-mlx into this environment")

    monkeypatch.setattr(process, "host_command", not_installed)
    assert cli.main(["bench", "server", "--quick", "--no-openblas", "--host", "rapid"]) == 2
    assert "--host rapid: no `rapid-mlx` command" in capsys.readouterr().err


def test_the_demo_on_omlx_without_omlx_installed_is_refused_before_the_run(
    no_work: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "omlx", None)
    assert cli.main(["demo", "--quick", "--no-openblas", "--host", "omlx"]) == 2
    assert "--host omlx needs oMLX installed" in capsys.readouterr().err


def test_the_omlx_fault_bench_without_omlx_is_an_error_not_a_skip(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lab.cli import main as lab_main

    monkeypatch.setitem(sys.modules, "omlx", None)
    assert lab_main(["faults", "--host", "omlx", "--runs", "1", "--no-openblas"]) == 2
    assert "--host omlx needs oMLX installed" in capsys.readouterr().err


def test_good_options_reach_the_command(no_work: None, tmp_path: Path) -> None:
    with pytest.raises(WorkStarted):
        cli.main(["demo", "--quick", "--no-openblas", "--json", str(tmp_path / "r.json")])
