"""The runnable gate: each condition, alone, keeps a slice from starting, and says why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import pytest

from mlx_recovery_plugin.recovery import runnable as gate_module
from mlx_recovery_plugin.recovery.budget import Budget
from mlx_recovery_plugin.recovery.outcomes import Refusal
from mlx_recovery_plugin.recovery.registry import ArrivalRegistry
from mlx_recovery_plugin.recovery.runnable import (
    GateDecision,
    RunnableGate,
    memory_probe,
)
from mlx_recovery_plugin.testing.clock import FakeClock


@dataclass
class EngineState:
    """Only the engine's queue and route flags: the gate reads nothing else."""

    engine_id: str
    model_id: str
    waiting: bool = False
    busy: bool = False
    sparse: bool = False
    broken: bool = False

    def queues_empty(self) -> bool:
        if self.broken:
            raise RuntimeError("host gone")
        return not self.waiting

    def is_busy(self) -> bool:
        if self.broken:
            raise RuntimeError("host gone")
        return self.busy

    def sparse_route_live(self) -> bool:
        return self.sparse


@dataclass
class World:
    registry: ArrivalRegistry = field(default_factory=ArrivalRegistry)
    clock: FakeClock = field(default_factory=FakeClock)
    budget: Budget = field(init=False)
    engines: dict[str, EngineState] = field(default_factory=dict)
    opted_in: set[str] = field(default_factory=lambda: {"m-a", "m-b"})
    memory_fine: bool = True

    def __post_init__(self) -> None:
        self.budget = Budget(20.0, 10.0, clock=self.clock)
        self.engines = {"e1": EngineState("e1", "m-a"), "e2": EngineState("e2", "m-b")}

    def gate(self) -> RunnableGate:
        return RunnableGate(
            self.registry,
            self.budget,
            engines=lambda: list(self.engines.values()),
            opted_in=lambda model_id: model_id in self.opted_in,
            idle_steps_for=lambda model_id: 3,
            memory_ok=lambda: self.memory_fine,
        )


@pytest.fixture
def world() -> World:
    return World()


def test_an_idle_opted_in_process_with_budget_is_runnable(world: World) -> None:
    decision = world.gate().check(world.engines["e1"], consecutive_idle=3)
    assert decision == GateDecision(True, None)
    assert decision


Breaker = Callable[[World], None]

SINGLE_CONDITIONS: list[tuple[str, Breaker]] = [
    (Refusal.MODEL_NOT_OPTED_IN, lambda w: w.opted_in.discard("m-a")),
    (Refusal.QUEUES_BUSY, lambda w: setattr(w.engines["e1"], "waiting", True)),
    (Refusal.SPARSE_ROUTE_LIVE, lambda w: setattr(w.engines["e1"], "sparse", True)),
    (Refusal.OTHER_ENGINE_BUSY, lambda w: setattr(w.engines["e2"], "busy", True)),
    (Refusal.OTHER_ENGINE_BUSY, lambda w: setattr(w.engines["e2"], "waiting", True)),
    (Refusal.FOREGROUND_ACTIVE, lambda w: w.registry.arrived("e2", "req-1")),
    (Refusal.FOREGROUND_ACTIVE, lambda w: w.registry.arrived("e1", "req-1")),
    (Refusal.BUDGET_SPENT, lambda w: w.budget.charge(2.0)),
    (Refusal.BUDGET_OFF, lambda w: w.budget.set_pct(0.0)),
    (Refusal.CLAIM_TAKEN, lambda w: w.budget.try_claim("e2")),
    (Refusal.MEMORY_PRESSURE, lambda w: setattr(w, "memory_fine", False)),
    (Refusal.HOST_ERROR, lambda w: setattr(w.engines["e1"], "broken", True)),
    (Refusal.OTHER_ENGINE_BUSY, lambda w: setattr(w.engines["e2"], "broken", True)),
]


@pytest.mark.parametrize(
    ("reason", "breaker"),
    SINGLE_CONDITIONS,
    ids=[f"{reason}-{i}" for i, (reason, _) in enumerate(SINGLE_CONDITIONS)],
)
def test_each_condition_alone_blocks_with_its_reason(
    world: World, reason: str, breaker: Breaker
) -> None:
    breaker(world)
    decision = world.gate().check(world.engines["e1"], consecutive_idle=3)
    assert decision == GateDecision(False, reason)
    assert not decision


def test_too_few_idle_steps_blocks_until_the_engine_has_idled_enough(world: World) -> None:
    gate = world.gate()
    engine = world.engines["e1"]
    assert gate.check(engine, consecutive_idle=2) == GateDecision(False, Refusal.NOT_ENOUGH_IDLE_STEPS)
    assert gate.check(engine, consecutive_idle=3).runnable


def test_the_gate_reopens_once_the_foreground_request_departs(world: World) -> None:
    gate = world.gate()
    engine = world.engines["e1"]
    world.registry.arrived("e2", "r")
    world.registry.admitted("e2", "r")
    assert gate.check(engine, 3).reason == Refusal.FOREGROUND_ACTIVE
    world.registry.departed("e2", "r")
    assert gate.check(engine, 3).runnable


def test_the_engines_own_claim_does_not_block_it(world: World) -> None:
    assert world.budget.try_claim("e1")
    assert world.gate().check(world.engines["e1"], 3).runnable


def test_a_spent_budget_reopens_in_the_next_window(world: World) -> None:
    gate = world.gate()
    world.budget.charge(2.0)
    assert gate.check(world.engines["e1"], 3).reason == Refusal.BUDGET_SPENT
    world.clock.now += 10.0
    assert gate.check(world.engines["e1"], 3).runnable


def test_refusals_and_yeses_take_no_claim_and_charge_nothing(world: World) -> None:
    gate = world.gate()
    before = world.budget.snapshot()
    world.engines["e2"].busy = True
    gate.check(world.engines["e1"], 3)
    world.engines["e2"].busy = False
    gate.check(world.engines["e1"], 3)
    after = world.budget.snapshot()
    assert world.budget.claimed_by is None
    assert after["used_in_window_s"] == before["used_in_window_s"] == 0.0


def test_a_budget_off_process_never_runs_any_engine(world: World) -> None:
    world.budget.set_pct(0.0)
    gate = world.gate()
    for engine in world.engines.values():
        for idle in (1, 3, 100):
            assert not gate.check(engine, idle).runnable


def test_memory_probe_refuses_above_its_fraction_of_the_limit() -> None:
    active = {"bytes": 400}
    ok = memory_probe(0.5, limit_bytes=1000, active_bytes=lambda: active["bytes"])
    assert ok()
    active["bytes"] = 501
    assert not ok()


def test_memory_probe_reads_mlx_active_memory() -> None:
    held = mx.ones((4096,), dtype=mx.float32)
    mx.eval(held)
    assert mx.get_active_memory() > 1
    assert not memory_probe(0.5, limit_bytes=2)()
    assert memory_probe(0.5, limit_bytes=1 << 50)()
    del held


def test_memory_probe_without_a_known_device_limit_lets_recovery_run(monkeypatch) -> None:
    monkeypatch.setattr(gate_module, "device_memory_limit", lambda: None)
    assert memory_probe(0.01, active_bytes=lambda: 1 << 40)()


def test_memory_probe_that_cannot_read_memory_does_not_block() -> None:
    def unreadable() -> int:
        raise RuntimeError("no metal")

    assert memory_probe(0.5, limit_bytes=1000, active_bytes=unreadable)()


def test_memory_probe_rejects_a_nonsense_fraction() -> None:
    with pytest.raises(ValueError):
        memory_probe(0.0, limit_bytes=1)
    with pytest.raises(ValueError):
        memory_probe(1.5, limit_bytes=1)


def test_device_memory_limit_is_unknown_or_a_positive_size() -> None:
    limit = gate_module.device_memory_limit()
    assert limit is None or (isinstance(limit, int) and limit > 0)


def test_held_memory_bound_is_the_setting_when_set_else_an_eighth_of_memory_at_least_256_mib() -> None:
    mib = 2**20
    assert gate_module.held_memory_bound(0.0, 64 << 30) == 0
    assert gate_module.held_memory_bound(100.0, 64 << 30) == 100 * mib
    # A 16 GiB machine holds 2 GiB back: about 8,000 tokens of a 32-layer float32 model.
    assert gate_module.held_memory_bound(None, 16 << 30) == 2048 * mib
    assert gate_module.held_memory_bound(None, 1 << 30) == 256 * mib
    assert gate_module.held_memory_bound(None, None) == 256 * mib


def test_machine_memory_is_the_device_limit_where_mlx_reports_one(monkeypatch) -> None:
    monkeypatch.setattr(gate_module, "device_memory_limit", lambda: 48 << 30)
    assert gate_module.machine_memory_bytes() == 48 << 30
    monkeypatch.setattr(gate_module, "device_memory_limit", lambda: None)
    physical = gate_module.machine_memory_bytes()
    # Linux and macOS both report their physical memory through sysconf.
    assert isinstance(physical, int) and physical >= 256 << 20
