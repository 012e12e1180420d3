"""Telling the slow bundled BLAS from OpenBLAS, and saying how to fix it once."""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import mlx.core as mx
import pytest

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
    env = blas.preload_env(OPENBLAS, {"LD_PRELOAD": f"/x/libfoo.so:{OPENBLAS}", "A": "1"})
    assert env["LD_PRELOAD"] == f"{OPENBLAS}:/x/libfoo.so"
    assert env["A"] == "1"
    assert blas.preload_env(OPENBLAS, {})["LD_PRELOAD"] == OPENBLAS


def test_reexec_runs_the_module_again_under_openblas_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(blas, "detect", lambda: blas.BlasInfo("reference", BUNDLED))
    monkeypatch.setattr(blas, "openblas_preload_path", lambda: OPENBLAS)
    monkeypatch.setattr(blas.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv(blas.REEXEC_MARKER, raising=False)

    blas.reexec_with_openblas("some.module", ["--flag", "1"])
    (exe, argv, env), = calls
    assert argv[1:] == ["-m", "some.module", "--flag", "1"]
    assert env["LD_PRELOAD"].split(":")[0] == OPENBLAS and env[blas.REEXEC_MARKER] == "1"

    monkeypatch.setenv(blas.REEXEC_MARKER, "1")  # the child does not go round again
    blas.reexec_with_openblas("some.module", [])
    assert len(calls) == 1


def test_no_reexec_when_already_fast_or_nothing_to_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(blas.REEXEC_MARKER, raising=False)
    monkeypatch.setattr(blas.os, "execve", lambda *a: pytest.fail("must not re-execute"))
    monkeypatch.setattr(blas, "detect", lambda: blas.BlasInfo("openblas", OPENBLAS))
    blas.reexec_with_openblas("m", [])
    monkeypatch.setattr(blas, "detect", lambda: blas.BlasInfo("reference", BUNDLED))
    monkeypatch.setattr(blas, "openblas_preload_path", lambda: None)
    blas.reexec_with_openblas("m", [])
