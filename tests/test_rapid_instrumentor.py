"""The rapid-mlx adapter's attachment: version-gated, exact uninstrument, attached by the
start-up hook from the environment alone, and light to import."""

from __future__ import annotations

import logging
import os
import sys

import pytest

os.environ.setdefault("RAPID_MLX_TELEMETRY", "0")
pytest.importorskip("rapid_mlx.scheduler", reason="rapid-mlx is not installed; CI installs it in .venv-rapid")

from rapid_mlx.engine_core import EngineCore
from rapid_mlx.scheduler import Scheduler

import hooked_python
from mlx_recovery_plugin.hosts.rapid import instrumentor as rapid_instrumentor
from mlx_recovery_plugin.hosts.rapid.instrumentor import RapidInstrumentor, version_supported
from mlx_recovery_plugin.hosts.rapid.wrappers import FACTORIES
from mlx_recovery_plugin.plugins import make_plugin_manager

CLASSES = {"Scheduler": Scheduler, "EngineCore": EngineCore}


def run_python(code: str, **env: str) -> dict:
    """:func:`hooked_python.run_python`, with rapid-mlx's telemetry off."""
    result: dict = hooked_python.run_python(code, **{**env, "RAPID_MLX_TELEMETRY": "0"})
    return result


def test_only_the_versions_it_was_written_against_are_supported() -> None:
    assert version_supported("0.16.10")
    assert version_supported("0.16.12rc1")
    assert not version_supported("0.16.9")
    assert not version_supported("0.17.0")
    assert not version_supported("0")


def test_an_unknown_version_is_refused_with_a_clear_log_line_and_nothing_is_wrapped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(rapid_instrumentor, "rapid_version", lambda: "0.18.0")
    before = {name: CLASSES[c].__dict__.get(name) for c, name in FACTORIES}
    adapter = RapidInstrumentor()
    with caplog.at_level(logging.WARNING):
        assert adapter.instrument(make_plugin_manager([], entry_points_too=False)) is False
    assert "rapid-mlx 0.18.0 is not supported" in caplog.text
    assert not adapter.is_instrumented
    assert {name: CLASSES[c].__dict__.get(name) for c, name in FACTORIES} == before


def test_uninstrument_puts_back_exactly_what_was_there_and_both_are_idempotent() -> None:
    before = {(c, name): CLASSES[c].__dict__.get(name) for c, name in FACTORIES}
    adapter = RapidInstrumentor()
    pm = make_plugin_manager([], entry_points_too=False)
    assert adapter.instrument(pm) and adapter.instrument(pm)
    wrapped = {(c, name): CLASSES[c].__dict__.get(name) for c, name in FACTORIES}
    assert all(getattr(w, "__mlx_recovery_wrapper__", False) for w in wrapped.values())
    adapter.uninstrument()
    adapter.uninstrument()
    after = {(c, name): CLASSES[c].__dict__.get(name) for c, name in FACTORIES}
    assert all(after[key] is before[key] for key in before)


def test_the_environment_alone_attaches_it_when_rapid_mlx_is_imported() -> None:
    code = """
        import rapid_mlx.engine_core
        from rapid_mlx.scheduler import Scheduler
        print(json.dumps({"wrapped": getattr(Scheduler.step, "__mlx_recovery_wrapper__", False)}))
    """
    assert run_python(code, MLX_RECOVERY_ENABLE="1") == {"wrapped": True}
    assert run_python(code) == {"wrapped": False}


def test_the_adapter_module_imports_no_mlx_asyncio_or_rapid_mlx() -> None:
    got = run_python(
        """
        from importlib.metadata import entry_points  # the test's own tool, not counted
        before = set(sys.modules)
        import mlx_recovery_plugin.hosts.rapid
        (ep,) = [e for e in entry_points(group="mlx_recovery_plugin.hosts") if e.name == "rapid_mlx"]
        ep.load()
        (pkg,) = [e for e in entry_points(group="mlx_recovery_plugin.host_packages") if e.name == "rapid_mlx"]
        new = sorted(m.split(".")[0] for m in set(sys.modules) - before)
        print(json.dumps({"new": sorted(set(new)), "package": pkg.value}))
        """
    )
    new = set(got["new"])
    assert not new & {"mlx", "asyncio", "rapid_mlx", "vllm_mlx", "pluggy", "pydantic", "numpy"}, new
    assert new - {"mlx_recovery_plugin"} <= set(sys.stdlib_module_names), new
    assert got["package"] == "rapid_mlx"
