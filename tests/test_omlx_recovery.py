"""Recovery on the real scheduler of each oMLX family member (flyto-mlx, fusion-mlx),
through the family adapter and the recovery plugin:
recovered prefixes are restored and serve like the dense route, foreground work comes
first, and reset or unload in the middle of recovery leaves no block reference behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.demo.arms import ServeConfig
from mlx_recovery_plugin.demo.omlx import OmlxArm
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.hosts.omlx.members import Member
from mlx_recovery_plugin.ports import FetchedPrefix, ModelHandle
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.recovery.service import default_runner_factory
from mlx_recovery_plugin.settings import ModelSettings, PublishPolicy, RecoverySettings
from mlx_recovery_plugin.testing.contract import EventRecorder, contract_tokens, stored_tokens
from mlx_recovery_plugin.testing.omlx_host import OmlxContractHost
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model
from waiting import wait_until

BLOCK = 64
THRESHOLD = 256  # prompts whose uncached part is longer take the sparse route
WAIT_S = 60.0
THINK_S = 30.0


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path, tiny_draft_dir: Path) -> tuple[Any, Any, Any]:
    model, tokenizer = load_tiny_model(tiny_llama_dir)
    draft, _ = load_tiny_model(tiny_draft_dir)
    return model, tokenizer, draft


def growing_conversation(sizes: Sequence[int]) -> list[list[int]]:
    """Prompts of the given lengths, each one the previous one plus appended tokens."""
    tokens = contract_tokens(max(sizes), seed=3)
    return [tokens[:size] for size in sizes]


def test_later_turns_restore_recovered_blocks_and_generate_like_the_dense_route(
    models: tuple[Any, Any, Any], tmp_path: Path, omlx_member: Member
) -> None:
    model, tokenizer, draft = models
    # 320: sparse. 470: the recovered 320 plus 150 new, dense. 870: 422 uncached after the
    # dense route stored 448, sparse again. 1020: the recovered 832 plus 188 new, dense.
    prompts = growing_conversation([320, 470, 870, 1020])
    # Restoring and generating, not the policy: the auto policy's verdicts here come from
    # a tiny model's wall-clock timings, which another process on the machine turns into
    # "not yet clear" holds (seen in CI, and 1 of 3 runs under a two-core load before
    # publications waited for the conversation's return; 3 of 3 since, where one verdict
    # at the arrival decides instead of several over the gap).
    config = ServeConfig(
        model_id="tiny", block_size=BLOCK, prefill_step=128, sparse_threshold=THRESHOLD,
        max_tokens=6, budget_pct=50.0, pool_blocks=512, publish_policy=PublishPolicy.ALWAYS,
    )
    arms = {arm: OmlxArm(arm, model, tokenizer, draft, config, tmp_path / arm, member=omlx_member)
            for arm in ("sparse_off", "sparse_on", "sparse_recovery")}
    try:
        for turn, prompt in enumerate(prompts):
            for arm in arms.values():
                arm.serve(prompt, turn)
                arm.think(THINK_S)
    finally:
        for arm in arms.values():
            arm.close()  # raises if any block reference was left behind

    off, on, rec = (arms[a] for a in ("sparse_off", "sparse_on", "sparse_recovery"))
    assert [t.route for t in on.result.turns] == ["sparse"] * 4
    assert [t.cached_tokens for t in on.result.turns] == [0, 0, 0, 0]
    assert [t.route for t in rec.result.turns] == ["sparse", "dense", "sparse", "dense"]
    assert rec.result.turns[1].cached_tokens == 320
    assert rec.result.turns[3].cached_tokens == 832
    assert rec.outputs[1] == off.outputs[1]
    assert rec.outputs[3] == off.outputs[3]
    assert rec.result.recovered_tokens >= 320 + 832 - 448


# -- a runner that can be held at one point, on the engine thread --------------------------


class Hold:
    """Stops the recovery runner at ``begin`` (only when resuming from a restored prefix)
    or ``advance``, after skipping ``skip`` such calls, until released."""

    def __init__(self) -> None:
        self.point: str | None = None
        self.skip = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def arm(self, point: str, skip: int = 0) -> None:
        self.point, self.skip = point, skip
        self.reached.clear()
        self.release.clear()

    def check(self, point: str) -> None:
        if self.point != point:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self.point = None
        self.reached.set()
        assert self.release.wait(WAIT_S), "the test never released the held slice"


class HeldRunner:
    def __init__(self, inner: Any, hold: Hold) -> None:
        self.inner, self.hold = inner, hold

    def begin(self, tokens: Sequence[int], prefix: FetchedPrefix | None) -> Any:
        if prefix is not None and prefix.tokens > 0:
            self.hold.check("begin")
        return self.inner.begin(tokens, prefix)

    def advance(self, live: Any, end: int, should_stop: Callable[[], bool] | None = None, stop_grain: int | None = None) -> Any:
        self.hold.check("advance")
        return self.inner.advance(live, end, should_stop, stop_grain)

    def discard(self, live: Any) -> None:
        self.inner.discard(live)


class Signals:
    """Releases a held slice the moment the host reports arrival or shutdown (tryfirst:
    before the recovery plugin hears of it)."""

    def __init__(self, hold: Hold) -> None:
        self.hold = hold
        self.release_on: set[str] = set()
        self.arrived = threading.Event()

    @hookimpl(tryfirst=True)
    def request_arrived(self, event: Any) -> None:
        self.arrived.set()
        if "arrival" in self.release_on:
            self.hold.release.set()

    @hookimpl(tryfirst=True)
    def engine_shutdown(self, engine_id: str) -> None:
        if "shutdown" in self.release_on:
            self.hold.release.set()


def recovery_plugin(model_id: str, hold: Hold) -> RecoveryPlugin:
    def factory(model: ModelHandle, block_size: int, interruptible: bool) -> Any:
        return HeldRunner(default_runner_factory(model, block_size, interruptible), hold)

    return RecoveryPlugin(
        # Publication mechanics on partial prefixes: the auto policy would hold a partial
        # prefix under a next turn that stays sparse.
        settings=RecoverySettings(
            budget_pct=100.0, slice_tokens=BLOCK, idle_steps=1,
            models={model_id: ModelSettings(enabled=True)}, publish_policy="always",
        ),
        runner_factory=factory,
        control_socket=False,
    )


@pytest.fixture
def hold() -> Hold:
    return Hold()


@pytest.fixture
def setup(
    models: tuple[Any, Any, Any], hold: Hold, omlx_member: Member
) -> Iterator[tuple[OmlxContractHost, RecoveryPlugin, EventRecorder, Signals]]:
    model, tokenizer, draft = models
    plugin = recovery_plugin("tiny-recovering", hold)
    recorder, signals = EventRecorder(), Signals(hold)
    host = OmlxContractHost(
        model, tokenizer, draft, block_size=BLOCK, sparse_threshold=THRESHOLD,
        plugins=[plugin, recorder, signals], model_id="tiny-recovering", member=omlx_member,
    )
    try:
        yield host, plugin, recorder, signals
    finally:
        hold.release.set()
        host.close()
        plugin.close()


def counters(plugin: RecoveryPlugin, host: OmlxContractHost) -> Any:
    service = plugin.service(host.engine.engine_id)
    assert service is not None
    return service.snapshot().counters


def interrupt_recovery_with_an_arrival(
    host: OmlxContractHost, hold: Hold, signals: Signals, sparse_prompt: list[int]
) -> str:
    """Serve a sparse request, hold recovery's second slice, let a dense request arrive
    while it is held, and return that request's id once it was served."""
    hold.arm("advance", skip=1)
    sparse = host.submit(sparse_prompt, max_tokens=4, sparse=True)
    assert host.wait(sparse, WAIT_S).output_tokens
    assert hold.reached.wait(WAIT_S), "recovery never started its second slice"
    signals.release_on = {"arrival"}
    submitted: list[str] = []
    # EngineCore.add_request waits for the engine thread, which the held slice occupies.
    submitter = threading.Thread(
        target=lambda: submitted.append(host.submit(contract_tokens(100, seed=8), max_tokens=4))
    )
    submitter.start()
    submitter.join(WAIT_S)
    signals.release_on = set()
    assert host.wait(submitted[0], WAIT_S).output_tokens
    return submitted[0]


def test_an_arrival_during_a_slice_is_served_before_recovery_goes_on(setup: Any, hold: Hold) -> None:
    host, plugin, recorder, signals = setup
    prompt = contract_tokens(12 * BLOCK, seed=5)
    host.start()
    try:
        dense = interrupt_recovery_with_an_arrival(host, hold, signals, prompt)
        # The last block is in the cache a moment before the job is booked as done.
        wait_until(lambda: counters(plugin, host).jobs_completed == 1, "recovery to finish")
        finished = counters(plugin, host)
        assert stored_tokens(host, prompt) == len(prompt)
    finally:
        host.stop()

    hooks = [(e.hook, e.request_id) for e in recorder.snapshot()]
    arrived = hooks.index(("request_arrived", dense))
    departed = hooks.index(("request_departed", dense))
    assert "engine_idle_step" not in [hook for hook, _ in hooks[arrived:departed]]
    assert "engine_idle_step" in [hook for hook, _ in hooks[departed:]]
    assert finished.slices_interrupted == 1
    assert finished.jobs_completed == 1 and finished.tokens_recovered == len(prompt)
    assert host.outstanding_refs() == {}


def test_unload_while_a_slice_holds_restored_blocks_leaves_no_reference(setup: Any, hold: Hold) -> None:
    host, plugin, recorder, signals = setup
    prompt = contract_tokens(12 * BLOCK, seed=6)
    host.start()
    interrupt_recovery_with_an_arrival(host, hold, signals, prompt)
    # Recovery resumes from the blocks it published: fetch (references taken), begin...
    hold.arm("begin")
    assert hold.reached.wait(WAIT_S), "recovery never resumed from its published prefix"
    held_at_unload = dict(host.outstanding_refs())
    signals.release_on = {"shutdown"}
    host.unload()  # EngineCore.stop() + close(): shutdown, deep reset, model released

    assert any(key.startswith("block") for key in held_at_unload)  # the resume held blocks
    assert host.outstanding_refs() == {}  # ...and gave every one back before oMLX tore down
    assert plugin.service(host.engine.engine_id) is None
    assert [e.hook for e in recorder.named("model_unloaded")] == ["model_unloaded"]


def test_reset_in_the_middle_of_a_recovery_job_leaves_no_reference_and_recovery_goes_on(
    setup: Any, hold: Hold
) -> None:
    host, plugin, _, _ = setup
    first = contract_tokens(12 * BLOCK, seed=7)
    sparse = host.submit(first, max_tokens=4, sparse=True)
    host.run_until_idle()
    assert host.result(sparse).output_tokens
    host.drive_idle(max_steps=3)  # a few slices: part of the job published, a live state kept
    partly = stored_tokens(host, first)
    assert 0 < partly < len(first)

    cache = host.scheduler.block_aware_cache
    at_clear: list[dict[str, Any]] = []
    original_clear = cache.clear
    cache.clear = lambda: (at_clear.append(dict(host.outstanding_refs())), original_clear())[1]
    try:
        host.reset(deep=False)
    finally:
        del cache.clear
    assert at_clear == [{}]
    assert host.outstanding_refs() == {}
    assert counters(plugin, host).jobs_cancelled == 1

    again = contract_tokens(10 * BLOCK, seed=9)
    rid = host.submit(again, max_tokens=4, sparse=True)
    host.run_until_idle()
    assert host.result(rid).output_tokens
    host.drive_idle(max_steps=100)
    assert stored_tokens(host, again) == len(again)
    assert host.outstanding_refs() == {}


def test_the_sparse_route_report_carries_oMLX_threshold_keep_and_prefill_time(
    models: tuple[Any, Any, Any], omlx_member: Member
) -> None:
    """What the publish policy weighs: oMLX's own threshold and keep share for the
    request, and how long its sparse prefill took (admission to first token)."""
    model, tokenizer, draft = models
    recorder = EventRecorder()
    with OmlxContractHost(
        model, tokenizer, draft, block_size=BLOCK, sparse_threshold=THRESHOLD, sparse_keep=0.3,
        plugins=[recorder], model_id="tiny-route", member=omlx_member,
    ) as host:
        started = time.perf_counter()
        rid = host.submit(contract_tokens(24 * BLOCK, seed=21), max_tokens=1, sparse=True)
        host.run_until_idle()
        whole = time.perf_counter() - started
        assert host.result(rid).output_tokens
    (served,) = [e.payload for e in recorder.snapshot() if e.hook == "sparse_route_served"]
    assert served.threshold == THRESHOLD
    assert served.keep == pytest.approx(0.3)
    # oMLX prefills inside admission: timed from after it, the figure was a few ms.
    assert served.prefill_s is not None and 0.5 * whole < served.prefill_s <= whole


def test_a_vision_request_keyed_by_an_image_hash_is_reported_as_such() -> None:
    """oMLX keys a vision request's blocks by its image too; the adapter says so, and
    recovery refuses the job (tested on the plugin side in test_recovery_progress)."""
    from types import SimpleNamespace

    from mlx_recovery_plugin.hosts.omlx.lifecycle import EngineRecord, Lifecycle, LiveRequest
    from mlx_recovery_plugin.plugins import HookEmitter, make_plugin_manager

    life = Lifecycle(HookEmitter(make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False)), time.monotonic)
    record = EngineRecord("e", SimpleNamespace(model_id="m"), driver=None)  # type: ignore[arg-type]
    record.live["r"] = LiveRequest(in_scheduler=True, admitted=True, arrived_at=time.monotonic())
    request = SimpleNamespace(
        specprefill_indices=[0], prompt_token_ids=list(range(300)), cached_tokens=0,
        vlm_extra_keys_for_cache=["image-hash"],
    )
    event = life.sparse_served(record, SimpleNamespace(running={"r": request}), "r")
    assert event is not None and event.keyed_beyond_tokens
    request.vlm_extra_keys_for_cache = None
    assert not life.sparse_served(record, SimpleNamespace(running={"r": request}), "r").keyed_beyond_tokens
