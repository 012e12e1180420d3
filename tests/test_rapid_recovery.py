"""Recovery on the real rapid-mlx scheduler, through the rapid-mlx adapter and the recovery
plugin: a PFlash-compressed turn is recovered under its original tokens as a whole entry,
the next turn's own lookup finds it and appends densely (PFlash's uncached basis), and
what rapid-mlx empties (reset, the idle cache clear) takes recovery's jobs with it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAPID_MLX_TELEMETRY", "0")
pytest.importorskip("rapid_mlx.scheduler", reason="rapid-mlx is not installed; CI installs it in .venv-rapid")

from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import ModelSettings, RecoverySettings
from mlx_recovery_plugin.testing.contract import EventRecorder, contract_tokens, stored_tokens
from mlx_recovery_plugin.testing.rapid_host import RapidContractHost
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model
from waiting import wait_until

BLOCK = 64
THRESHOLD = 256  # PFlash compresses a prompt whose uncached part is longer
MODEL = "tiny-recovering"
WAIT_S = 60.0


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_llama_dir)


class IdleThreads:
    """Notes the thread every idle step runs on."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @hookimpl
    def engine_idle_step(self, event: Any) -> None:
        self.names.append(threading.current_thread().name)


def make_host(models: tuple[Any, Any], *plugins: object, recovery: bool = True) -> tuple[RapidContractHost, RecoveryPlugin | None]:
    # Publication mechanics on partial prefixes: the auto policy would hold a partial
    # prefix under a next turn that stays sparse.
    settings = RecoverySettings(
        budget_pct=100.0 if recovery else 0.0, slice_tokens=4 * BLOCK, idle_steps=1,
        models={MODEL: ModelSettings(enabled=True)}, publish_policy="always",
    )
    plugin = RecoveryPlugin(settings=settings, control_socket=False) if recovery else None
    pm = make_plugin_manager([p for p in (plugin, *plugins) if p is not None], settings=settings, entry_points_too=False)
    model, tokenizer = models
    host = RapidContractHost(
        model=model, tokenizer=tokenizer, block_size=BLOCK, pflash_threshold=THRESHOLD, pm=pm, model_id=MODEL,
    )
    return host, plugin


@pytest.fixture
def rig(models: tuple[Any, Any]) -> Iterator[tuple[RapidContractHost, RecoveryPlugin, EventRecorder]]:
    recorder = EventRecorder()
    host, plugin = make_host(models, recorder)
    assert plugin is not None
    try:
        yield host, plugin, recorder
    finally:
        host.close()
        plugin.close()


def serve(host: RapidContractHost, prompt: list[int], *, sparse: bool = True) -> Any:
    rid = host.submit(prompt, max_tokens=6, sparse=sparse)
    host.run_until_idle()
    return host.result(rid)


def counters(plugin: RecoveryPlugin, host: RapidContractHost) -> Any:
    service = plugin.service(host.engine.engine_id)
    assert service is not None
    return service.snapshot().counters


def test_a_compressed_turn_is_recovered_and_the_next_turn_appends_densely_on_it(
    rig: Any, models: tuple[Any, Any]
) -> None:
    host, plugin, recorder = rig
    conversation = contract_tokens(12 * BLOCK + 100, seed=31)
    turn1, turn2 = conversation[: 12 * BLOCK], conversation
    first = serve(host, turn1)
    assert first.compressed and first.cached_tokens == 0
    (served,) = recorder.named("sparse_route_served")
    assert tuple(served.payload.tokens) == tuple(turn1)  # the original prompt, not the kept tokens
    assert first.kept_tokens is not None and first.kept_tokens < len(turn1)

    host.drive_idle(max_steps=200)
    assert stored_tokens(host, turn1) == len(turn1)
    done = counters(plugin, host)
    assert done.jobs_completed == 1 and done.tokens_recovered == len(turn1)
    assert host.outstanding_refs() == {}

    second = serve(host, turn2)
    assert not second.compressed  # 100 uncached tokens: below PFlash's threshold
    assert second.cached_tokens >= len(turn1)

    # What the same turn costs without recovery, and what the dense route makes of it.
    control, _ = make_host(models, recovery=False)
    try:
        serve(control, turn1)
        again = serve(control, turn2)
        assert again.compressed and again.cached_tokens == 0
        cold = serve(control, turn2, sparse=False)
    finally:
        control.close()
    assert second.output_tokens == cold.output_tokens


def test_the_idle_cache_clear_drops_recovery_jobs_and_leaves_nothing_taken(rig: Any) -> None:
    host, plugin, recorder = rig
    prompt = contract_tokens(16 * BLOCK, seed=32)
    assert serve(host, prompt).compressed
    host.drive_idle(max_steps=2)  # part of the job published, a live state kept
    partly = stored_tokens(host, prompt)
    assert 0 < partly < len(prompt)

    assert host.clear_prefix_cache()  # what --idle-cache-clear-seconds does when it fires
    assert [e.payload for e in recorder.named("engine_reset")] == [True]
    assert stored_tokens(host, prompt) == 0
    cleared = counters(plugin, host)
    assert cleared.jobs_cancelled == 1
    assert host.drive_idle(max_steps=50) <= 1  # nothing left to work on
    assert stored_tokens(host, prompt) == 0
    assert host.outstanding_refs() == {}


def test_reset_in_the_middle_of_a_job_cancels_it_and_recovery_goes_on_with_the_next(rig: Any) -> None:
    host, plugin, _ = rig
    first = contract_tokens(16 * BLOCK, seed=33)
    assert serve(host, first).compressed
    host.drive_idle(max_steps=2)
    assert 0 < stored_tokens(host, first) < len(first)
    host.reset(deep=False)  # rapid-mlx's reset empties its prefix cache too
    assert counters(plugin, host).jobs_cancelled == 1
    assert stored_tokens(host, first) == 0

    again = contract_tokens(10 * BLOCK, seed=34)
    assert serve(host, again).compressed
    host.drive_idle(max_steps=200)
    assert stored_tokens(host, again) == len(again)
    assert host.outstanding_refs() == {}


def test_in_the_real_engine_loop_recovery_runs_only_on_the_mlx_step_thread(models: tuple[Any, Any]) -> None:
    threads = IdleThreads()
    host, plugin = make_host(models, threads)
    assert plugin is not None
    prompt = contract_tokens(10 * BLOCK, seed=35)
    host.start()
    try:
        rid = host.submit(prompt, max_tokens=4, sparse=True)
        assert host.wait(rid, WAIT_S).compressed
        wait_until(lambda: counters(plugin, host).jobs_completed == 1, "recovery to finish in the engine loop")
        assert stored_tokens(host, prompt) == len(prompt)
    finally:
        host.close()
        plugin.close()
    assert threads.names and all(name.startswith("mlx-step") for name in threads.names)
    assert host.outstanding_refs() == {}
