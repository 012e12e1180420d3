"""Fault injection at every point of a recovery slice: the fault is counted by kind, the job
is parked or dropped, no block reference stays taken, nothing reaches the host's step, and
the foreground answers exactly as in a run without faults."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.ports import FetchedPrefix
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.recovery.service import PARK_BASE_S
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock
from mlx_recovery_plugin.testing.host import MockHost

B = 64
STEP = 128
MODEL = "tiny"
# These rigs test publication mechanics on partial prefixes; the auto policy would hold
# a partial prefix under a next turn that stays sparse (see tests/test_costs.py).
SETTINGS = RecoverySettings(
    budget_pct=50.0, idle_steps=2, models={MODEL: {"enabled": True}}, publish_policy="always",
)

FIRST_PROMPT = [random.Random(1).randrange(256) for _ in range(520)]  # 4 slices of work
SECOND_PROMPT = FIRST_PROMPT + [random.Random(2).randrange(256) for _ in range(90)]


@dataclass
class Injector:
    """Which operation fails, on its how-manieth call, and how."""

    point: str
    at: int
    fail: Callable[..., Any]
    calls: dict[str, int] = field(default_factory=dict)

    def hit(self, point: str) -> bool:
        self.calls[point] = self.calls.get(point, 0) + 1
        return point == self.point and self.calls[point] == self.at


class FaultyRunner:
    def __init__(self, inner: SliceRunner, injector: Injector) -> None:
        self.inner = inner
        self.injector = injector
        self.open: set[int] = set()

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        if self.injector.hit("begin"):
            self.injector.fail()
        live = self.inner.begin(tokens, prefix)
        self.open.add(id(live))
        return live

    def advance(self, live: Any, end: int, should_stop: Any = None, stop_grain: int | None = None) -> Any:
        if self.injector.hit("advance"):
            self.injector.fail()
        return self.inner.advance(live, end, should_stop, stop_grain)

    def discard(self, live: Any) -> None:
        self.open.discard(id(live))
        self.inner.discard(live)


def raise_(exc: BaseException) -> Callable[..., Any]:
    def fail(*_: Any) -> Any:
        raise exc

    return fail


def install_cache_faults(cache: Any, injector: Injector) -> None:
    """Fail the cache's recovery calls (holder ids ``mlx-recovery:*``); the host's own
    calls go through untouched."""
    real_fetch, real_store = cache.fetch, cache.store

    def fetch(holder: str, tokens: Sequence[int]) -> FetchedPrefix:
        if holder.startswith("mlx-recovery:"):
            point = "probe" if ":probe:" in holder else "fetch"
            if injector.hit(point):
                return injector.fail(real_fetch, holder, tokens)
        return real_fetch(holder, tokens)

    def store(holder: str, tokens: Sequence[int], blocks: Sequence[Any]) -> int:
        if holder.startswith("mlx-recovery:") and injector.hit("store"):
            return injector.fail(real_store, holder, tokens, blocks)
        return real_store(holder, tokens, blocks)

    real_release = cache.release

    def release(holder: str) -> None:
        if holder.startswith("mlx-recovery:"):
            point = "probe_release" if ":probe:" in holder else "release"
            if injector.hit(point):
                return injector.fail(real_release, holder)
        return real_release(holder)

    cache.fetch, cache.store, cache.release = fetch, store, release


def fetch_then_raise(real_fetch: Callable[..., Any], holder: str, tokens: Sequence[int]) -> Any:
    real_fetch(holder, tokens)  # the references are taken, then the host fails
    raise RuntimeError("cache lost")


def short_fetch(real_fetch: Callable[..., Any], holder: str, tokens: Sequence[int]) -> Any:
    return real_fetch(holder, tokens[: max(0, len(tokens) - B)])


def store_nothing(real_store: Callable[..., Any], holder: str, tokens: Sequence[Any], blocks: Any) -> int:
    return 0


@dataclass
class Run:
    host: MockHost
    plugin: RecoveryPlugin
    clock: FakeClock
    runners: list[FaultyRunner]
    outputs: list[tuple[int, ...]]



def session(
    loaded,
    injector: Injector | None,
    *,
    host_gone: bool = False,
    idle: Callable[[MockHost, FakeClock], None] | None = None,
) -> Run:
    """A sparse turn, idle time (where the fault strikes), then a dense turn."""
    model, tokenizer, draft = loaded
    injector = injector or Injector("none", 0, raise_(AssertionError()))
    runners: list[FaultyRunner] = []

    def factory(handle: Any, block_size: int, interruptible: bool) -> FaultyRunner:
        if injector.hit("runner"):
            injector.fail()
        runners.append(FaultyRunner(SliceRunner(handle, block_size, interruptible=interruptible), injector))
        return runners[-1]

    clock = FakeClock()
    plugin = RecoveryPlugin(SETTINGS, clock=clock, runner_factory=factory, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=SETTINGS, entry_points_too=False))
    engine = host.add_engine(
        "e", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
        block_size=B, prefill_step=STEP, sparse_threshold=16,
    )
    install_cache_faults(engine.prefix_cache, injector)
    outputs = []
    rid = host.submit("e", FIRST_PROMPT, sparse=True, max_tokens=4)
    host.run_until_idle()
    outputs.append(host.result(rid).output_tokens)
    if host_gone:
        def gone() -> bool:
            raise ReferenceError("engine is gone")

        engine.sparse_route_live = gone  # type: ignore[method-assign]
    if idle is None:
        host.drive_idle()
    else:
        idle(host, clock)
    if host_gone:
        del engine.sparse_route_live
    rid = host.submit("e", SECOND_PROMPT, sparse=False, max_tokens=6)
    host.run_until_idle()
    outputs.append(host.result(rid).output_tokens)
    return Run(host, plugin, clock, runners, outputs)


@pytest.fixture(scope="module")
def clean(loaded) -> Run:
    run = session(loaded, None)
    assert run.plugin.status()["process"]["faults"] == {}
    assert run.host.result("e-2").cached_tokens == 512
    return run


def check_isolated(run: Run, clean: Run) -> dict[str, Any]:
    assert run.host.leaked() == {}
    assert run.host.emitter.errors == 0  # nothing was raised into the host
    assert all(not r.open for r in run.runners)
    assert run.outputs == clean.outputs
    return run.plugin.status()["engines"]["e"]


PARKING = [
    ("advance", 1, raise_(RuntimeError("kernel failed")), "runner_error"),
    ("advance", 3, raise_(RuntimeError("kernel failed")), "runner_error"),
    ("advance", 2, raise_(MemoryError()), "oom"),
    ("advance", 1, raise_(RuntimeError("[malloc] Unable to allocate 4096 bytes")), "oom"),
    ("begin", 1, raise_(RuntimeError("bad prefix")), "runner_error"),
]


@pytest.mark.parametrize("point, at, fail, kind", PARKING, ids=[f"{p[0]}{p[1]}-{p[3]}" for p in PARKING])
def test_runner_faults_park_the_job_with_back_off_and_it_resumes_later(loaded, clean, point, at, fail, kind) -> None:
    run = session(loaded, Injector(point, at, fail))
    status = check_isolated(run, clean)
    assert status["counters"]["faults"] == {kind: 1}
    (job,) = status["jobs"]  # parked, not dropped
    assert job["attempts"] == 1 and job["parked_for_s"] == pytest.approx(PARK_BASE_S)
    assert run.host.last_idle_retry_after == pytest.approx(PARK_BASE_S)
    # The dense turn extended nothing (it was not sparse); after the back-off the job
    # finishes from its committed block.
    run.clock.now += PARK_BASE_S
    run.host.drive_idle()
    status = check_isolated(run, clean)
    assert status["jobs"] == []
    assert run.host.engines["e"].prefix_cache.stored_tokens(FIRST_PROMPT) == 512
    run.plugin.close()


DROPPING = [
    ("store", 1, raise_(RuntimeError("disk full")), "store_error", 0),
    # The first slice is one block (no rate measured yet), the later ones STEP tokens.
    ("store", 2, raise_(RuntimeError("disk full")), "store_error", B),
    ("store", 1, store_nothing, "store_refused", 0),
    ("probe", 1, short_fetch, "probe_mismatch", 0),
    ("probe", 3, short_fetch, "probe_mismatch", B + STEP),
    ("probe", 1, fetch_then_raise, "fetch_error", 0),
    ("fetch", 1, fetch_then_raise, "fetch_error", 0),
    ("fetch", 1, raise_(RuntimeError("no cache")), "fetch_error", 0),
]


@pytest.mark.parametrize(
    "point, at, fail, kind, kept",
    DROPPING,
    ids=[f"{p[0]}{p[1]}-{p[3]}-{p[2].__name__}" for p in DROPPING],
)
def test_host_side_faults_drop_the_job_and_keep_what_was_committed(loaded, clean, point, at, fail, kind, kept) -> None:
    run = session(loaded, Injector(point, at, fail))
    status = check_isolated(run, clean)
    assert status["counters"]["faults"] == {kind: 1}
    assert status["jobs"] == [] and status["counters"]["jobs_dropped"] == 1
    assert status["counters"]["tokens_recovered"] == kept
    # The dense turn restored at least what was committed before the fault (a store
    # that went through before its probe failed may have left more).
    cached = run.host.result("e-2").cached_tokens
    assert cached == kept if point != "probe" else cached >= kept
    run.plugin.close()


def test_host_gone_drops_every_job_of_the_engine(loaded, clean) -> None:
    run = session(loaded, None, host_gone=True)
    status = check_isolated(run, clean)
    assert status["counters"]["faults"] == {"host_gone": 1}
    assert status["jobs"] == [] and status["counters"]["jobs_cancelled"] == 1
    run.plugin.close()


def test_a_model_that_cannot_get_a_runner_counts_as_host_gone(loaded, clean) -> None:
    run = session(loaded, Injector("runner", 1, raise_(AttributeError("model unloaded"))))
    status = check_isolated(run, clean)
    assert status["counters"]["faults"] == {"host_gone": 1}
    assert status["jobs"] == []
    run.plugin.close()


def test_a_job_failing_every_time_is_dropped_after_its_attempts(loaded, clean) -> None:
    injector = Injector("advance", 1, raise_(RuntimeError("always")))
    injector.hit = lambda point: point == "advance"  # type: ignore[method-assign]

    def idle(host: MockHost, clock: FakeClock) -> None:
        for _ in range(10):
            host.drive_idle()
            clock.now += 120.0

    run = session(loaded, injector, idle=idle)
    status = check_isolated(run, clean)
    assert status["jobs"] == [] and status["counters"]["jobs_dropped"] == 1
    assert status["counters"]["faults"]["runner_error"] == 5
    run.plugin.close()


def release_fails(real_release: Callable[..., Any], holder: str) -> None:
    raise RuntimeError("release failed")


@pytest.mark.parametrize("point", ["probe_release", "release"])
def test_a_failed_release_is_retried_and_costs_neither_the_job_nor_the_references(loaded, point) -> None:
    """The probe's read-back succeeded, only giving its references back failed: the job
    keeps what it committed, the fault is counted as a release error, and the next idle
    step gives the references back."""
    run = session(loaded, Injector(point, 1, release_fails))
    status = run.plugin.status()["engines"]["e"]
    assert status["counters"]["faults"] == {"release_error": 1}
    assert status["counters"]["jobs_dropped"] == 0
    assert status["unreleased_holders"] == 0, "retried on a later idle step"
    assert run.host.result("e-2").cached_tokens == 512, "the recovered prefix still served the turn"
    run.plugin.close()
    assert run.host.leaked() == {}


def test_references_of_a_failed_release_stay_held_until_retried(loaded) -> None:
    held: dict[str, Any] = {}

    def idle_once(host: MockHost, clock: FakeClock) -> None:
        engine = host.engines["e"]
        engine.offer_idle_step()  # no slice yet: idle steps 1 of 2
        engine.offer_idle_step()  # the first slice: publication, its probe's release fails
        held["after"] = {h for h in engine.prefix_cache.holders if h.startswith("mlx-recovery:")}
        held["status"] = run_status(host)
        host.drive_idle()

    def run_status(host: MockHost) -> dict[str, Any]:
        return plugin_of(host).status()["engines"]["e"]

    def plugin_of(host: MockHost) -> RecoveryPlugin:
        return next(p for p in host.pm.get_plugins() if isinstance(p, RecoveryPlugin))

    run = session(loaded, Injector("probe_release", 1, release_fails), idle=idle_once)
    assert len(held["after"]) == 1 and ":probe:" in next(iter(held["after"]))
    assert held["status"]["unreleased_holders"] == 1
    assert run.plugin.status()["engines"]["e"]["unreleased_holders"] == 0
    run.plugin.close()
    assert run.host.leaked() == {}


def test_a_reset_gives_back_what_a_failed_release_held(loaded) -> None:
    """Dropping every job (reset here; shutdown and unload take the same path) retries the
    failed release at once, before any later idle step."""
    seen: dict[str, Any] = {}

    def idle_once(host: MockHost, clock: FakeClock) -> None:
        engine = host.engines["e"]
        engine.offer_idle_step()
        engine.offer_idle_step()  # the probe's release fails here
        seen["before"] = [h for h in engine.prefix_cache.holders if h.startswith("mlx-recovery:")]
        engine.reset()
        seen["after"] = [h for h in engine.prefix_cache.holders if h.startswith("mlx-recovery:")]

    run = session(loaded, Injector("probe_release", 1, release_fails), idle=idle_once)
    assert len(seen["before"]) == 1
    assert seen["after"] == []
    run.plugin.close()
    assert run.host.leaked() == {}
