"""The recovery state machine: random interleavings of requests, idle time, aborts, resets, unloads and faults, on two
engines sharing a real tiny model, with the real runner, block pool and prefix cache.

Invariants after every step: no block reference outstanding, nothing raised into the
host, every prefix recovery stored is a prefix of one of its jobs' tokens (lineage), and
every job's committed boundary is block-aligned and restorable from the host's cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import random_tokens
from mlx_recovery_plugin.testing.host import MockHost

B = 32
STEP = 64
MODEL = "tiny"


def machine_settings() -> RecoverySettings:
    # Built when a machine starts, not at import: settings read the environment too, and
    # a bad variable must not break importing the CLI that would report it.
    return RecoverySettings(
        budget_pct=50.0, idle_steps=2, max_jobs_per_engine=2, models={MODEL: {"enabled": True}}
    )

FAULTS = ("advance_error", "advance_oom", "store_error", "probe_short", "fetch_error")
MAX_PROMPT = 420


class Armed:
    """One fault waiting for the next recovery call of its kind."""

    def __init__(self) -> None:
        self.kind: str | None = None

    def take(self, kind: str) -> bool:
        if self.kind == kind:
            self.kind = None
            return True
        return False


class Runner:
    def __init__(self, inner: SliceRunner, machine: RecoveryMachine) -> None:
        self.inner, self.machine = inner, machine

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        live = self.inner.begin(tokens, prefix)
        self.machine.open_lives.add(id(live))
        return live

    def advance(self, live: Any, end: int, should_stop: Any = None, stop_grain: int | None = None) -> Any:
        m = self.machine
        if m.armed.take("advance_error"):
            raise RuntimeError("injected kernel failure")
        if m.armed.take("advance_oom"):
            raise MemoryError("injected")
        if m.arrive_during_slice is not None:
            engine_id, m.arrive_during_slice = m.arrive_during_slice, None
            m.host.submit(engine_id, random_tokens(next(m.seeds), 40), max_tokens=2)
        return self.inner.advance(live, end, should_stop, stop_grain)

    def discard(self, live: Any) -> None:
        self.machine.open_lives.discard(id(live))
        self.inner.discard(live)


# The models every machine instance runs on: hypothesis builds the machine with no
# arguments, so run_recovery_machine() sets them for the run (the caller's thread only).
_LOADED: dict[str, Any] = {}


class RecoveryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        model, tokenizer, draft = _LOADED["models"]
        self.now = 0.0
        self.armed = Armed()
        self.open_lives: set[int] = set()
        self.lineage_violations: list[tuple[int, ...]] = []
        self.arrive_during_slice: str | None = None
        self.seeds = itertools.count(1000)
        settings = machine_settings()
        self.plugin = RecoveryPlugin(
            settings,
            clock=lambda: self.now,
            runner_factory=lambda h, b, i: Runner(SliceRunner(h, b, interruptible=i), self),
            control_socket=False,
        )
        self.host = MockHost(make_plugin_manager([self.plugin], settings=settings, entry_points_too=False))
        self.models = (model, tokenizer, draft)
        self.engine_ids = ["a0", "b0"]
        self.generation = itertools.count(1)
        for engine_id in self.engine_ids:
            self._add_engine(engine_id)
        self.conversations: dict[int, list[int]] = {}

    def _add_engine(self, engine_id: str) -> None:
        model, tokenizer, draft = self.models
        engine = self.host.add_engine(
            engine_id, model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
            block_size=B, prefill_step=STEP, sparse_threshold=8,
        )
        cache = engine.prefix_cache
        real_fetch, real_store = cache.fetch, cache.store

        def fetch(holder: str, tokens: Sequence[int]) -> Any:
            if holder.startswith("mlx-recovery:"):
                if ":probe:" in holder and self.armed.take("probe_short"):
                    return real_fetch(holder, tokens[: len(tokens) - B])
                if ":start:" in holder and self.armed.take("fetch_error"):
                    raise RuntimeError("injected fetch failure")
            return real_fetch(holder, tokens)

        def store(holder: str, tokens: Sequence[int], blocks: Sequence[Any]) -> int:
            if holder.startswith("mlx-recovery:"):
                service = self.plugin.service(engine_id)
                jobs = list(service.book) if service is not None else []
                if not any(job.tokens[: len(tokens)] == tuple(tokens) for job in jobs):
                    self.lineage_violations.append(tuple(tokens))
                if self.armed.take("store_error"):
                    raise RuntimeError("injected store failure")
            return real_store(holder, tokens, blocks)

        cache.fetch, cache.store = fetch, store

    # -- rules -------------------------------------------------------------------------

    @rule(engine=st.integers(0, 1), conv=st.integers(0, 2), add=st.integers(1, 3), sparse=st.booleans())
    def request(self, engine: int, conv: int, add: int, sparse: bool) -> None:
        prompt = self.conversations.get(conv, random_tokens(conv, 60))
        prompt = prompt + random_tokens(next(self.seeds), 40 * add)
        if len(prompt) > MAX_PROMPT:
            prompt = random_tokens(next(self.seeds), 100)
        rid = self.host.submit(self.engine_ids[engine], prompt, sparse=sparse, max_tokens=2)
        self.host.run_until_idle()
        self.conversations[conv] = prompt + list(self.host.result(rid).output_tokens)

    @rule(conv=st.integers(0, 2))
    def fork(self, conv: int) -> None:
        prompt = self.conversations.get(conv)
        if prompt:
            self.conversations[conv] = prompt[: len(prompt) * 3 // 4]

    @rule(steps=st.integers(1, 8))
    def idle(self, steps: int) -> None:
        self.host.drive_idle(max_steps=steps)

    @rule(engine=st.integers(0, 1))
    def arrival_during_next_slice(self, engine: int) -> None:
        self.arrive_during_slice = self.engine_ids[engine]
        self.host.drive_idle(max_steps=6)
        self.arrive_during_slice = None
        self.host.run_until_idle()

    @rule(engine=st.integers(0, 1))
    def abort_one(self, engine: int) -> None:
        rid = self.host.submit(self.engine_ids[engine], random_tokens(next(self.seeds), 80), sparse=True)
        self.host.abort(rid)
        self.host.run_until_idle()

    @rule(engine=st.integers(0, 1), how=st.sampled_from(["abort_all", "fail_all", "reset", "deep_reset"]))
    def engine_event(self, engine: int, how: str) -> None:
        engine_id = self.engine_ids[engine]
        if how == "abort_all":
            self.host.abort_all(engine_id)
        elif how == "fail_all":
            self.host.fail_all(engine_id, "injected")
        else:
            self.host.reset(engine_id, deep=how == "deep_reset")
        self.host.run_until_idle()

    @precondition(lambda self: len(self.host.engines) < 8)
    @rule(engine=st.integers(0, 1))
    def unload(self, engine: int) -> None:
        old = self.engine_ids[engine]
        self.host.unload(old)
        new = f"{old[0]}{next(self.generation)}"
        self.engine_ids[engine] = new
        self._add_engine(new)

    @rule(kind=st.sampled_from(FAULTS))
    def arm_fault(self, kind: str) -> None:
        self.armed.kind = kind

    @rule()
    def time_passes(self) -> None:
        self.now += 30.0

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def no_reference_outstanding(self) -> None:
        assert self.host.leaked() == {}

    @invariant()
    def nothing_raised_into_the_host(self) -> None:
        assert self.host.emitter.errors == 0

    @invariant()
    def publication_stays_inside_job_lineage(self) -> None:
        assert self.lineage_violations == []

    @invariant()
    def committed_boundaries_are_block_aligned_and_restorable(self) -> None:
        for engine_id in self.engine_ids:
            service = self.plugin.service(engine_id)
            if service is None:
                continue
            cache = self.host.engines[engine_id].prefix_cache
            for job in service.book:
                assert job.committed % B == 0
                assert job.committed <= job.publish_end(B)
                assert cache.stored_tokens(job.tokens) >= job.committed

    @invariant()
    def live_state_only_while_idle_and_recovering(self) -> None:
        assert len(self.open_lives) <= len(self.engine_ids)

    def teardown(self) -> None:
        self.plugin.close()
        assert self.open_lives == set()
        assert self.host.leaked() == {}


def run_recovery_machine(models: tuple[Any, Any, Any], hypothesis_settings: Any, machine: type[RecoveryMachine] = RecoveryMachine) -> None:
    """Run ``machine`` on ``models`` (target, tokenizer, draft); raises on the first
    falsified invariant, after hypothesis has shrunk it."""
    _LOADED["models"] = models
    try:
        run_state_machine_as_test(machine, settings=hypothesis_settings)
    finally:
        _LOADED.clear()
