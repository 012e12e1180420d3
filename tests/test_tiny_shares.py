"""A budget share too small to be a share is refused everywhere it can be set, and no
wait the budget or an idle driver computes is ever infinite or unbounded (issue 22, 9)."""

from __future__ import annotations

import argparse
import math
import threading

import pytest

from mlx_recovery_plugin import control_cli
from mlx_recovery_plugin.hosts.idle_offers import MAX_IDLE_DELAY_S, parse_results
from mlx_recovery_plugin.hosts.rapid.idle_driver import IdleDriver
from mlx_recovery_plugin.recovery.budget import MAX_WAIT_S, Budget
from mlx_recovery_plugin.settings import MIN_BUDGET_PCT, SettingsError, load_settings
from mlx_recovery_plugin.testing.clock import FakeClock

TINY = [1e-320, 1e-300, 1e-9, MIN_BUDGET_PCT / 2]


@pytest.mark.parametrize("pct", TINY)
def test_a_budget_below_the_smallest_share_is_refused_naming_the_minimum(pct: float) -> None:
    with pytest.raises(ValueError, match=r"0\.01"):
        Budget(pct, 10.0, clock=FakeClock())
    budget = Budget(5.0, 10.0, clock=FakeClock())
    with pytest.raises(ValueError, match=r"0\.01"):
        budget.set_pct(pct)
    assert budget.pct == 5.0


@pytest.mark.parametrize("pct", ["1e-320", "1e-300", "0.001"])
def test_the_setting_refuses_a_tiny_share_naming_the_variable(monkeypatch: pytest.MonkeyPatch, pct: str) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", pct)
    with pytest.raises(SettingsError, match=r"MLX_RECOVERY_BUDGET_PCT.*0\.01"):
        load_settings()


def test_the_budget_command_refuses_a_tiny_share_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(pct=1e-320, socket="/nonexistent/never-used.sock", json=False)
    assert control_cli.budget_command(args) == 2
    assert "0.01" in capsys.readouterr().err


def test_the_smallest_share_and_a_huge_overshoot_ask_for_a_finite_bounded_wait() -> None:
    clock = FakeClock()
    budget = Budget(MIN_BUDGET_PCT, 0.1, clock=clock)
    budget.charge(1e9)  # a slice that ran "for ever" (a clock jump, a suspended laptop)
    wait = budget.seconds_until_available()
    assert math.isfinite(wait) and 0 < wait <= MAX_WAIT_S
    clock.advance(wait)
    assert math.isfinite(budget.seconds_until_available())


def test_an_absurd_idle_delay_is_clamped_to_a_bounded_one() -> None:
    again, delays = parse_results([1e301, 5.0])
    assert not again and max(delays) <= MAX_IDLE_DELAY_S and 5.0 in delays


def test_the_rapid_idle_timer_thread_survives_an_absurd_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    driver = IdleDriver(FakeClock())
    driver.waker = lambda: None
    driver.wake()
    driver.record_results([1e301])
    timer = driver._timer
    assert timer is not None
    timer.join(0.3)  # before the clamp, the thread died at once with OverflowError
    driver.stop()
    timer.join(5.0)
    assert died == []
