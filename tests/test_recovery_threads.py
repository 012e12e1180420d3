"""The recovery plugin in the mock host's threaded mode: one loop thread per engine, as the
real server runs. An unload from a control thread stops a running slice and drops its
state; a request arriving on another engine during recovery gets the same answer as on
a cold host; recovery then finishes by itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import random_tokens
from mlx_recovery_plugin.testing.host import MockHost

B = 64
MODEL = "tiny"
# Publication's mechanics, not the policy: every finished slice is published at once
# (the default policy would hold a prefix until its conversation returns).
SETTINGS = RecoverySettings(budget_pct=100.0, idle_steps=2, models={MODEL: {"enabled": True}}, publish_policy="always")
WAIT_S = 60.0  # generous bound on waits for another thread; never a timing assertion


class BlockingRunner:
    """The real runner; while ``hold`` is set, a slice waits at its start until its stop
    signal turns True (the slice is "running" when the stop request comes)."""

    def __init__(self, inner: SliceRunner) -> None:
        self.inner = inner
        self.hold = threading.Event()
        self.started = threading.Event()
        self.open: set[int] = set()
        self.lock = threading.Lock()
        self.outcomes: list[Any] = []

    def begin(self, tokens: Sequence[int], prefix: Any) -> Any:
        live = self.inner.begin(tokens, prefix)
        with self.lock:
            self.open.add(id(live))
        return live

    def advance(self, live: Any, end: int, should_stop: Any = None, stop_grain: int | None = None) -> Any:
        if self.hold.is_set():
            self.started.set()
            deadline = time.monotonic() + WAIT_S
            while not should_stop() and time.monotonic() < deadline:
                time.sleep(0.002)
        outcome = self.inner.advance(live, end, should_stop, stop_grain)
        self.outcomes.append(outcome)
        return outcome

    def discard(self, live: Any) -> None:
        with self.lock:
            self.open.discard(id(live))
        self.inner.discard(live)



def build(loaded, engines: Sequence[str]) -> tuple[MockHost, RecoveryPlugin, list[BlockingRunner]]:
    model, tokenizer, draft = loaded
    runners: list[BlockingRunner] = []

    def factory(handle: Any, block_size: int, interruptible: bool) -> BlockingRunner:
        runners.append(BlockingRunner(SliceRunner(handle, block_size, interruptible=interruptible)))
        return runners[-1]

    plugin = RecoveryPlugin(SETTINGS, runner_factory=factory, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=SETTINGS, entry_points_too=False))
    for engine_id in engines:
        host.add_engine(
            engine_id, model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
            block_size=B, prefill_step=128, sparse_threshold=16,
        )
    return host, plugin, runners


def wait_until(predicate: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def test_unload_from_a_control_thread_stops_the_running_slice_and_drops_everything(loaded) -> None:
    host, plugin, runners = build(loaded, ["e"])
    host.start()
    try:
        rid = host.submit("e", random_tokens(1, 700), sparse=True, max_tokens=2)
        host.wait(rid, WAIT_S)
        wait_until(lambda: runners)
        runner = runners[0]
        runner.hold.set()
        assert runner.started.wait(WAIT_S)
        plugin.model_unloaded("e", MODEL)  # from this (control) thread, mid-slice
        assert "e" not in plugin.status()["engines"]
        wait_until(lambda: not runner.open)
        assert any(o.interrupted for o in runner.outcomes)
    finally:
        host.stop()
    assert host.leaked() == {}
    plugin.close()


def test_request_on_another_engine_during_recovery_is_answered_as_on_a_cold_host(loaded) -> None:
    host, plugin, runners = build(loaded, ["e1", "e2"])
    probe_prompt = random_tokens(3, 200)
    reference_host = MockHost(make_plugin_manager([], settings=SETTINGS, entry_points_too=False))
    model, tokenizer, _ = loaded
    reference_host.add_engine("cold", model=model, tokenizer=tokenizer, block_size=B, prefill_step=128)
    ref = reference_host.submit("cold", probe_prompt, max_tokens=4)
    reference_host.run_until_idle()
    expected = reference_host.result(ref).output_tokens

    host.start()
    try:
        long_prompt = random_tokens(2, 900)
        host.wait(host.submit("e1", long_prompt, sparse=True, max_tokens=2), WAIT_S)
        wait_until(lambda: runners)
        runners[0].hold.set()
        assert runners[0].started.wait(WAIT_S)
        runners[0].hold.clear()
        answer = host.wait(host.submit("e2", probe_prompt, max_tokens=4), WAIT_S)
        assert answer.output_tokens == expected
        cache = host.engines["e1"].prefix_cache
        wait_until(lambda: plugin.status()["engines"]["e1"]["jobs"] == [])
        assert cache.stored_tokens(long_prompt) == len(long_prompt) // B * B
        assert any(o.interrupted for o in runners[0].outcomes)
    finally:
        host.stop()
    assert host.leaked() == {}
    assert all(not r.open for r in runners)
    plugin.close()


class StoppingLife:
    """What the shared ``EngineCore.stop`` wrapper asks of a host lifecycle, around the
    mock host's engine ``e`` and the real plugin manager."""

    def __init__(self, host: MockHost) -> None:
        from mlx_recovery_plugin.plugins import HookEmitter

        self.emitter = HookEmitter(host.pm)
        self.record = type("Record", (), {"engine_id": "e"})()

    def get(self, scheduler: Any) -> Any:
        return self.record

    def safe(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def detach(self, record: Any) -> bool:
        return True


def test_engine_stop_on_an_event_loop_keeps_the_loop_serving_and_nothing_is_stored_after_it(loaded) -> None:
    import asyncio

    from mlx_recovery_plugin.hosts import wrapping

    host, plugin, _ = build(loaded, ["e"])
    cache = host.engines["e"].prefix_cache
    events: list[str] = []
    in_store, let_store_finish = threading.Event(), threading.Event()
    real_store = cache.store

    def slow_store(holder: str, tokens: Any, blocks: Any) -> int:
        if not holder.startswith("mlx-recovery:"):
            return real_store(holder, tokens, blocks)
        events.append("store begins")
        in_store.set()
        let_store_finish.wait(WAIT_S)
        stored = real_store(holder, tokens, blocks)
        events.append("store ends")
        return stored

    cache.store = slow_store  # type: ignore[method-assign]

    async def host_stop(engine: Any) -> None:
        events.append("host stop")

    stop = wrapping.engine_stop(StoppingLife(host), host_stop, {})
    engine = type("EngineCore", (), {"scheduler": object()})()

    async def server() -> None:
        stopped = False

        async def other_streams() -> None:
            ticks = 0
            while not stopped:
                ticks += 1
                if ticks == 3:  # the loop is serving while the stop waits: let the store end
                    events.append("loop served")
                    let_store_finish.set()
                await asyncio.sleep(0.005)

        streams = asyncio.create_task(other_streams())
        await stop(engine)
        stopped = True
        events.append("stop returned")
        await streams

    host.start()
    try:
        host.wait(host.submit("e", random_tokens(5, 700), sparse=True, max_tokens=2), WAIT_S)
        assert in_store.wait(WAIT_S), "recovery never reached its store"
        asyncio.run(server())
    finally:
        let_store_finish.set()
        host.stop()
    assert events.index("loop served") < events.index("store ends") < events.index("host stop")
    assert events[-2:] == ["host stop", "stop returned"] and events.count("store begins") == 1
    assert "e" not in plugin.status()["engines"]
    assert host.leaked() == {}
    plugin.close()


def test_status_never_reads_the_cost_model_the_engine_thread_is_changing() -> None:
    """The publish policy's status is a value built whole on the engine thread: a status
    read from another thread touches none of the live samples."""
    from mlx_recovery_plugin.recovery.judge import PublishJudge
    from mlx_recovery_plugin.settings import PublishPolicy

    judge = PublishJudge(PublishPolicy.AUTO, 16)
    for context in (0, 64, 128, 192):
        judge.observe(context, 64, 0.01 + context * 1e-5)
    before = judge.status()

    class Mutating:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("deque mutated during iteration")

    judge.costs = Mutating()  # type: ignore[assignment]
    status = judge.status()
    assert status == before and status["dense_cost_samples"] == 4
    assert status["dense_s_per_token"] is not None
    try:
        status["mode"] = "always"  # type: ignore[index]
    except TypeError:
        pass
    else:
        raise AssertionError("a status handed to another thread must be read-only")


def test_status_read_in_a_loop_while_slices_run_never_raises(loaded) -> None:
    host, plugin, _ = build(loaded, ["e"])
    errors: list[BaseException] = []
    reads = 0
    host.start()
    try:
        for turn in range(3):
            host.wait(host.submit("e", random_tokens(20 + turn, 700), sparse=True, max_tokens=2), WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and plugin.status()["engines"]["e"]["jobs"]:
                try:
                    plugin.status()
                    plugin.counters()
                    reads += 1
                except Exception as exc:  # noqa: BLE001 - what the test looks for
                    errors.append(exc)
    finally:
        host.stop()
    assert errors == [] and reads > 0
    plugin.close()
