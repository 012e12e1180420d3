"""Telling the slow bundled BLAS from OpenBLAS, and saying how to fix it once."""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_recovery_plugin.bench import openblas
from mlx_recovery_plugin.runner import blas

BUNDLED = "/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "_warned", False)


def test_a_preloaded_openblas_is_recognised_over_the_bundled_library() -> None:
    info = blas.classify("Linux", False, OPENBLAS, [BUNDLED, OPENBLAS])
    assert info.kind == "openblas" and not info.slow_for_float32


def test_the_bundled_reference_blas_is_the_slow_path() -> None:
    info = blas.classify("Linux", False, None, [BUNDLED, "/usr/lib/libc.so.6"])
    assert info.kind == "reference" and info.slow_for_float32


def test_an_openblas_that_does_not_serve_mlx_does_not_count() -> None:
    # numpy's own OpenBLAS is loaded privately and exports renamed symbols.
    numpy_blas = "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-ff651d7f.so"
    info = blas.classify("Linux", False, None, [numpy_blas, BUNDLED])
    assert info.kind == "reference"


def test_macos_and_gpu_are_never_reported_slow() -> None:
    assert blas.classify("Darwin", False, None, []).kind == "accelerate"
    assert blas.classify("Linux", True, None, [BUNDLED]).kind == "gpu"


@pytest.mark.skipif(platform.system() != "Linux", reason="Linux CPU wheel only")
def test_detect_matches_how_this_process_was_started() -> None:
    preloaded = "openblas" in os.environ.get("LD_PRELOAD", "")
    assert blas.detect().kind == ("openblas" if preloaded else "reference")
    assert ("openblas" in blas.describe()) == preloaded


def test_warns_once_with_the_fix_for_float32_on_the_slow_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow = blas.BlasInfo("reference", BUNDLED)
    with caplog.at_level(logging.WARNING, logger=blas.__name__):
        assert blas.warn_once_if_slow(mx.float32, slow)
        assert not blas.warn_once_if_slow(mx.float32, slow)
    assert len(caplog.records) == 1
    assert "LD_PRELOAD=" in caplog.records[0].getMessage()


def test_no_warning_for_half_precision_or_a_fast_blas(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=blas.__name__):
        assert not blas.warn_once_if_slow(mx.bfloat16, blas.BlasInfo("reference"))
        assert not blas.warn_once_if_slow(mx.float32, blas.BlasInfo("openblas", OPENBLAS))
    assert caplog.records == []


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is a Linux fix")
def test_the_preload_path_is_the_first_installed_candidate(tmp_path: Path) -> None:
    present = tmp_path / "libopenblas.so.0"
    present.write_bytes(b"")
    assert blas.openblas_preload_path([str(tmp_path / "missing.so"), str(present)]) == str(present)
    assert blas.openblas_preload_path([str(tmp_path / "missing.so")]) is None


def test_preload_env_puts_openblas_first_once() -> None:
    env = openblas.preload_env(OPENBLAS, {"LD_PRELOAD": f"/x/libfoo.so:{OPENBLAS}", "A": "1"})
    assert env["LD_PRELOAD"] == f"{OPENBLAS}:/x/libfoo.so"
    assert env["A"] == "1"
    assert openblas.preload_env(OPENBLAS, {})["LD_PRELOAD"] == OPENBLAS


def _fake_wheel(tmp_path: Path, *, gfortran: bool = True, quadmath: bool = True) -> tuple[Path, Path]:
    library = tmp_path / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    bundled = tmp_path / "mlx_cpu.libs"
    bundled.mkdir()
    if gfortran:
        (bundled / "libgfortran-f7379c93.so.5.0.0").write_bytes(b"")
    if quadmath:
        (bundled / "libquadmath-a962d038.so.0.0.0").write_bytes(b"")
    return library, bundled


def test_the_system_openblas_is_preferred_and_the_wheel_is_the_fallback(tmp_path: Path) -> None:
    slow = blas.BlasInfo("reference", BUNDLED)
    wheel = _fake_wheel(tmp_path)
    choice = openblas.choose_openblas("auto", system="Linux", info=slow, system_library=OPENBLAS, wheel=wheel)
    assert choice.plan == openblas.OpenblasPlan("system", OPENBLAS)
    choice = openblas.choose_openblas("auto", system="Linux", info=slow, system_library=None, wheel=wheel)
    assert choice.plan is not None and choice.plan.source == "wheel"
    assert choice.plan.library == str(wheel[0])
    (link_dir,) = choice.plan.library_dirs
    # libopenblas asks for the plain sonames, libgfortran for quadmath's hashed name.
    names = {p.name: p.resolve().name for p in Path(link_dir).iterdir()}
    assert names["libgfortran.so.5"] == "libgfortran-f7379c93.so.5.0.0"
    assert names["libquadmath.so.0"] == names["libquadmath-a962d038.so.0.0.0"] == "libquadmath-a962d038.so.0.0.0"
    env = choice.plan.env({"LD_LIBRARY_PATH": "/x"})
    assert env["LD_PRELOAD"] == str(wheel[0]) and env["LD_LIBRARY_PATH"] == f"{link_dir}:/x"
    forced = openblas.choose_openblas("wheel", system="Linux", info=slow, system_library=OPENBLAS, wheel=wheel)
    assert forced.plan is not None and forced.plan.source == "wheel"


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"system": "Darwin"}, "macOS"),
        ({"info": blas.BlasInfo("gpu")}, "GPU"),
        ({"info": blas.BlasInfo("openblas", OPENBLAS)}, "already on OpenBLAS"),
        ({"wheel": (None, None)}, "cmeel-openblas wheel is not installed"),
        ({"gfortran": False}, "no libgfortran.so.5"),
        ({"quadmath": False}, "no libquadmath.so.0"),
        ({"mode": "off"}, "off"),
        ({"mode": "bogus"}, "not one of"),
        ({"mode": "system"}, "no system OpenBLAS"),
    ],
)
def test_says_in_one_line_why_openblas_does_not_apply(tmp_path: Path, kwargs: dict, why: str) -> None:
    wheel = _fake_wheel(tmp_path, gfortran=kwargs.pop("gfortran", True), quadmath=kwargs.pop("quadmath", True))
    args = {"mode": "auto", "system": "Linux", "info": blas.BlasInfo("reference", BUNDLED),
            "system_library": None, "wheel": wheel} | kwargs
    choice = openblas.choose_openblas(args.pop("mode"), **args)
    assert choice.plan is None
    assert why in choice.reason and "\n" not in choice.reason


def test_reexec_runs_the_same_command_again_under_openblas_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(
        openblas, "choose_openblas", lambda mode=None: openblas.OpenblasChoice(openblas.OpenblasPlan("system", OPENBLAS), "x")
    )
    monkeypatch.setattr(openblas.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv(openblas.REEXEC_MARKER, raising=False)
    monkeypatch.setattr(openblas.sys, "orig_argv", ["python", "/venv/bin/mlx-recovery", "demo", "--quick"])

    openblas.reexec_with_openblas()
    (exe, argv, env), = calls
    assert exe == openblas.sys.executable and argv[1:] == ["/venv/bin/mlx-recovery", "demo", "--quick"]
    assert env["LD_PRELOAD"].split(":")[0] == OPENBLAS and env[openblas.REEXEC_MARKER] == "1"

    monkeypatch.setenv(openblas.REEXEC_MARKER, "1")  # the child does not go round again
    openblas.reexec_with_openblas()
    assert len(calls) == 1


def test_no_reexec_when_nothing_applies_and_the_reason_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(openblas.REEXEC_MARKER, raising=False)
    monkeypatch.setattr(openblas.os, "execve", lambda *a: pytest.fail("must not re-execute"))
    monkeypatch.setattr(openblas, "choose_openblas", lambda mode=None: openblas.OpenblasChoice(None, "because"))
    assert openblas.reexec_with_openblas().plan is None
    assert capsys.readouterr().err == "OpenBLAS: because\n"


def _wheel_installed() -> bool:
    library, bundled = openblas.wheel_files()
    return library is not None and library.is_file() and bundled is not None


@pytest.mark.skipif(platform.system() != "Linux", reason="the wheel's OpenBLAS is a Linux fix")
@pytest.mark.skipif(not _wheel_installed(), reason="needs the openblas extra (cmeel-openblas) and mlx-cpu")
def test_a_subprocess_reexecs_onto_the_wheels_openblas_without_the_system_one(tmp_path: Path) -> None:
    """What a fresh machine gets: no LD_PRELOAD, the system library ignored, the command
    re-run through the wheel's library, and MLX's products then served by it."""
    import subprocess
    import sys

    script = (
        "from mlx_recovery_plugin.bench import openblas\n"
        "from mlx_recovery_plugin.runner import blas\n"
        "openblas.reexec_with_openblas()\n"
        "import mlx.core as mx\n"
        "a = mx.ones((64, 64)); mx.eval(a @ a)\n"
        "info = blas.detect(); print(info.kind, info.library)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", openblas.REEXEC_MARKER)}
    env[openblas.OPENBLAS_ENV] = "wheel"
    env["XDG_CACHE_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kind, library = done.stdout.split()
    assert kind == "openblas" and library == str(openblas.wheel_files()[0])
    assert "re-running under OpenBLAS from the cmeel-openblas wheel" in done.stderr
