"""``python tests/lab faults`` at a tiny size: every fault kind is injected, nothing leaks,
nothing reaches the host, no dense output differs from a cold host's; and the checks can
fail (a leaking plugin, a plugin that raises into the host, a wrong output)."""

from __future__ import annotations

from typing import Any

import pytest

from lab import faults
from lab.cli import build_parser
from lab.faults import FAULT_KINDS, format_result, run_fault_bench
from mlx_recovery_plugin.events import IdleStep
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.testing.clock import random_tokens


@pytest.fixture(scope="module")
def models(loaded) -> tuple[Any, Any, Any]:
    return loaded


def test_a_small_bench_injects_every_kind_and_stays_clean(models) -> None:
    result = run_fault_bench(40, seed=0, models=models)
    assert set(result.rows) == set(FAULT_KINDS)
    for row in result.rows.values():
        assert row.injected >= 1, row
        assert (row.leaked_refs, row.escapes, row.wrong_outputs, row.writes_after_unload) == (0, 0, 0, 0), result.failures
        assert row.dense_restored >= 1, "some dense requests were served from a cached prefix"
    assert result.ok
    for op in faults.OPS:
        assert result.ops.get(op, 0) >= 1, op
    table = format_result(result)
    assert table.startswith("BLAS: ") and "all clean" in table


class LeakingPlugin:
    """Takes references on the engine's cache on an idle step and never gives them back."""

    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}

    @hookimpl
    def engine_attached(self, engine: Any) -> None:
        self.engines[engine.engine_id] = engine

    @hookimpl
    def engine_idle_step(self, event: IdleStep) -> None:
        engine = self.engines[event.engine_id]
        for c in range(faults.CONVERSATIONS):  # whichever conversation the host has stored
            engine.prefix_cache.fetch(f"leaky:{event.consecutive}:{c}", random_tokens(1000 + c, 160))


class RaisingPlugin:
    @hookimpl
    def engine_reset(self, engine_id: str, deep: bool) -> None:
        raise RuntimeError("broken plugin")

    @hookimpl
    def request_departed(self, event: Any) -> None:
        raise RuntimeError("broken plugin")


def test_the_checks_count_leaks(models) -> None:
    result = run_fault_bench(5, seed=1, models=models, extra_plugins=lambda: [LeakingPlugin()])
    leaked = sum(r.leaked_refs for r in result.rows.values())
    assert leaked > 0 and not result.ok
    assert any("leaked" in f for f in result.failures)


def test_the_checks_count_exceptions_into_the_host(models) -> None:
    result = run_fault_bench(5, seed=2, models=models, extra_plugins=lambda: [RaisingPlugin()])
    assert sum(r.escapes for r in result.rows.values()) > 0 and not result.ok
    assert any("swallowed" in f for f in result.failures)


def test_the_checks_count_wrong_outputs(models, monkeypatch) -> None:
    real = faults.ColdReference.__call__

    def off_by_one(self, prompt, max_tokens, block_size, step):  # type: ignore[no-untyped-def]
        return tuple(t + 1 for t in real(self, prompt, max_tokens, block_size, step))

    monkeypatch.setattr(faults.ColdReference, "__call__", off_by_one)
    result = run_fault_bench(3, seed=3, models=models)
    assert sum(r.wrong_outputs for r in result.rows.values()) > 0 and not result.ok


def test_the_command_is_registered() -> None:
    args = build_parser().parse_args(["faults", "--runs", "3", "--seed", "7", "--no-openblas"])
    assert (args.runs, args.seed, args.no_openblas) == (3, 7, True)
    assert args.func is faults._run


def test_on_omlx_the_checks_count_leaks_and_exceptions_into_the_host(models) -> None:
    pytest.importorskip("omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests")
    from lab.faults_omlx import run_omlx_fault_bench

    leaky = run_omlx_fault_bench(3, seed=1, models=models, extra_plugins=lambda: [LeakingPlugin()])
    assert sum(r.leaked_refs for r in leaky.rows.values()) > 0 and not leaky.ok
    assert any("leaked" in f for f in leaky.failures)
    raising = run_omlx_fault_bench(3, seed=2, models=models, extra_plugins=lambda: [RaisingPlugin()])
    assert sum(r.escapes for r in raising.rows.values()) > 0 and not raising.ok
    assert any("swallowed" in f for f in raising.failures)


def test_the_host_option_is_registered() -> None:
    args = build_parser().parse_args(["faults", "--host", "omlx"])
    assert (args.host, args.runs) == ("omlx", None)
    assert build_parser().parse_args(["faults"]).host == "mock"


def test_on_omlx_every_kind_is_injected_and_nothing_leaks_or_escapes(models) -> None:
    pytest.importorskip("omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests")
    from lab.faults_omlx import run_omlx_fault_bench

    result = run_omlx_fault_bench(20, seed=0, models=models)
    for row in result.rows.values():
        assert row.injected >= 1, row
        assert (row.leaked_refs, row.escapes, row.wrong_outputs, row.writes_after_unload) == (0, 0, 0, 0), result.failures
        assert row.dense_checked >= 1, row
    assert sum(r.dense_restored for r in result.rows.values()) >= 1
    assert result.ok and "all clean" in format_result(result)


def test_on_omlx_the_checks_count_wrong_outputs(models, monkeypatch) -> None:
    pytest.importorskip("omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests")
    from lab import faults_omlx

    real = faults_omlx.OmlxColdReference.__call__

    def off_by_one(self, prompt, max_tokens, block_size, step):  # type: ignore[no-untyped-def]
        return tuple(t + 1 for t in real(self, prompt, max_tokens, block_size, step))

    monkeypatch.setattr(faults_omlx.OmlxColdReference, "__call__", off_by_one)
    result = faults_omlx.run_omlx_fault_bench(2, seed=3, models=models)
    assert sum(r.wrong_outputs for r in result.rows.values()) > 0 and not result.ok


def test_the_control_channel_under_load_fails_no_client_and_backs_off() -> None:
    from lab.faults_control import format_control_load, run_control_load

    result = run_control_load(60, deadline_s=0.5, starve_s=0.3)
    assert result.failed == [] and result.answered + result.busy == 60 and result.answered > 0
    assert result.answered_past_slow_s is not None and result.answered_after_starving
    assert result.ok, format_control_load(result)
