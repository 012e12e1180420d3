"""The order bench at toy size: with the plugin's own order, the conversation that comes
back first finds its whole prefix restored; with pure recency it does not.

The gaps are counted in slices rather than seconds, so the schedule's shape does not
depend on how fast the machine is: A (16 blocks) gets 14 slices, then B (16 blocks)
arrives and 4 more slices run before A comes back, enough for A's last 2 blocks. The
publish policy is ``always`` here: on a toy model its verdicts ride on millisecond
timings, and a full prefix it holds back for more evidence would hide what the order did."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lab.order import OrderSchedule, ordering, run_arm, serve_config
from mlx_recovery_plugin.demo.arms import ArmSession, Models
from mlx_recovery_plugin.recovery import service
from mlx_recovery_plugin.settings import env_name

SCHEDULE = OrderSchedule(a_tokens=1024, b_tokens=1024, append_tokens=64, sparse_threshold=768, block_size=64)
GAPS_IN_SLICES = (14.0, 4.0, 0.0)


def idle_for_slices(session: ArmSession, slices: float) -> None:
    """Offer idle steps until recovery has run ``slices`` more slices (or has no work)."""
    def ran() -> int:
        assert session.plugin is not None
        return int(session.plugin.status()["process"]["slices"])

    target = ran() + int(slices)
    for _ in range(10_000):
        if ran() >= target:
            return
        answers = session.engine.offer_idle_step()
        if any(a is True for a in answers):
            continue
        delays = [a for a in answers if isinstance(a, float) and a > 0]
        if not delays:
            return
        session.clock.advance(min(delays))


@pytest.fixture(scope="module")
def models(loaded: tuple[Any, Any, Any]) -> Models:
    return Models(*loaded)


def _arm(name: str, models: Models):
    config = serve_config(SCHEDULE, slice_tokens=SCHEDULE.block_size)
    return run_arm(name, models, SCHEDULE, GAPS_IN_SLICES, config=config, idle=idle_for_slices)


def test_default_order_restores_the_returning_conversation_in_full_and_recency_does_not(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_name("publish_policy"), "always")
    default, recency = _arm("default", models), _arm("recency", models)
    a_default, a_recency = default.returns[0], recency.returns[0]
    assert a_default.name == a_recency.name == "A"
    assert default.restorable_at_a_return["A"] == SCHEDULE.a_tokens
    assert a_default.cached_tokens == SCHEDULE.a_tokens
    assert a_recency.cached_tokens < SCHEDULE.a_tokens
    # Recency spent that idle time on B instead.
    assert recency.restorable_at_a_return["B"] >= default.restorable_at_a_return["B"]


def test_the_recency_arm_puts_the_plugins_threshold_back() -> None:
    saved = service.CLEARLY_MORE
    with ordering("recency"):
        assert math.isinf(service.CLEARLY_MORE)
    assert service.CLEARLY_MORE is saved
