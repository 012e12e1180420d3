"""Attaching to oMLX at run time: version gate, idempotence, exact restore, isolation of
plugin faults, and discovery through the host-adapter entry point."""

from __future__ import annotations

import time
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

omlx = pytest.importorskip(
    "omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests"
)

from omlx.engine_core import EngineCore
from omlx.scheduler import Scheduler

from mlx_recovery_plugin.demo.arms import ServeConfig
from mlx_recovery_plugin.demo.omlx import (
    make_scheduler,
    serve,
)
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.hosts import (
    HostAdapter,
    instrument_installed_hosts,
    load_host_adapters,
    uninstrument_all_hosts,
)
from mlx_recovery_plugin.hosts.instrumenting import parse_version
from mlx_recovery_plugin.hosts.omlx import OmlxInstrumentor, version_supported
from mlx_recovery_plugin.hosts.omlx.instrumentor import (
    ENGINE_CORE_METHODS,
    SCHEDULER_METHODS,
    iter_wrapped,
)
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.contract import EventRecorder, contract_tokens
from mlx_recovery_plugin.testing.omlx_host import make_request
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model

CONFIG = ServeConfig(model_id="tiny", block_size=64, prefill_step=128, sparse_threshold=1024, pool_blocks=256)


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_llama_dir)


@pytest.fixture
def recorder() -> EventRecorder:
    return EventRecorder()


@pytest.fixture
def instrumentor(recorder: EventRecorder) -> Iterator[OmlxInstrumentor]:
    inst = OmlxInstrumentor()
    pm = make_plugin_manager([recorder], settings=RecoverySettings(), entry_points_too=False)
    assert inst.instrument(pm=pm)
    yield inst
    inst.uninstrument()


def class_state() -> dict[str, dict[str, Any]]:
    return {cls.__name__: dict(vars(cls)) for cls in (Scheduler, EngineCore)}


def test_uninstrument_puts_back_the_very_same_objects() -> None:
    before = class_state()
    inst = OmlxInstrumentor()
    assert inst.instrument(pm=make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False))
    during = class_state()
    for name in SCHEDULER_METHODS:
        assert during["Scheduler"][name] is not before["Scheduler"][name]
    for name in ENGINE_CORE_METHODS:
        assert during["EngineCore"][name] is not before["EngineCore"][name]
    assert sorted(iter_wrapped([Scheduler, EngineCore])) == sorted(
        [f"Scheduler.{n}" for n in SCHEDULER_METHODS] + [f"EngineCore.{n}" for n in ENGINE_CORE_METHODS]
    )
    inst.uninstrument()
    after = class_state()
    for cls_name, attrs in before.items():
        assert after[cls_name].keys() == attrs.keys()
        for name, value in attrs.items():
            assert after[cls_name][name] is value, f"{cls_name}.{name} not restored"


def test_instrument_and_uninstrument_are_idempotent() -> None:
    before = class_state()
    inst = OmlxInstrumentor()
    pm = make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False)
    assert inst.instrument(pm=pm) and inst.instrument(pm=pm)
    assert Scheduler.step.__wrapped__ is before["Scheduler"]["step"]  # wrapped once, not twice
    inst.uninstrument()
    inst.uninstrument()
    assert not inst.is_instrumented
    assert class_state()["Scheduler"]["step"] is before["Scheduler"]["step"]


@pytest.mark.parametrize("version", ["0.6.9", "0.8.0", "1.0"])
def test_an_unsupported_oMLX_version_is_refused_and_nothing_changes(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    import omlx._version

    monkeypatch.setattr(omlx._version, "__version__", version)
    before = class_state()
    inst = OmlxInstrumentor()
    assert not inst.instrument(pm=make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False))
    assert not inst.is_instrumented
    assert class_state() == before


def test_an_oMLX_without_a_wrapped_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(Scheduler, "_cleanup_finished")
    before = class_state()
    inst = OmlxInstrumentor()
    assert not inst.instrument(pm=make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False))
    assert class_state() == before


def test_version_parsing_and_range() -> None:
    assert parse_version("0.7.0rc1") == (0, 7, 0)
    assert parse_version("0.7") == (0, 7)
    assert version_supported("0.7.0") and version_supported("0.7.12")
    assert not version_supported("0.8.0") and not version_supported("garbage")


class Exploding:
    """A plugin whose every hook raises."""

    @hookimpl
    def engine_attached(self, engine: Any) -> None:
        raise RuntimeError("boom")

    @hookimpl
    def request_arrived(self, event: Any) -> None:
        raise RuntimeError("boom")

    @hookimpl
    def request_admitted(self, event: Any) -> None:
        raise RuntimeError("boom")

    @hookimpl
    def request_departed(self, event: Any) -> None:
        raise RuntimeError("boom")

    @hookimpl
    def engine_idle_step(self, event: Any) -> Any:
        raise RuntimeError("boom")


def test_a_plugin_failing_in_every_hook_does_not_change_what_oMLX_serves(
    models: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = models
    prompt = contract_tokens(200, seed=1)
    plain = make_scheduler(model, tokenizer, tmp_path / "plain", CONFIG)
    expected = serve(plain, make_request("a", prompt, max_tokens=6, sparse=False)).output_tokens
    plain.shutdown()

    inst = OmlxInstrumentor()
    inst.instrument(pm=make_plugin_manager([Exploding()], settings=RecoverySettings(), entry_points_too=False))
    try:
        sched = make_scheduler(model, tokenizer, tmp_path / "instrumented", CONFIG)
        got = serve(sched, make_request("a", prompt, max_tokens=6, sparse=False)).output_tokens
        steps = 0
        while sched.has_requests() and steps < 50:  # the failing idle hook ends the offers
            sched.step()
            steps += 1
        assert not sched.has_requests()
        sched.shutdown()
    finally:
        inst.uninstrument()
    assert got == expected


def test_lifecycle_of_a_bare_scheduler_is_reported(
    instrumentor: OmlxInstrumentor, recorder: EventRecorder, models: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = models
    sched = make_scheduler(model, tokenizer, tmp_path / "c", CONFIG)
    port = instrumentor.attach(sched)
    assert port is not None and recorder.named("engine_attached")[0].payload is port
    served = serve(sched, make_request("r1", contract_tokens(150, seed=2), max_tokens=4, sparse=False))
    assert recorder.hooks_for("r1") == ["request_arrived", "request_admitted", "request_departed"]
    assert recorder.one("request_admitted", "r1").cached_tokens == served.row.cached_tokens == 0
    sched.shutdown()
    assert [e.hook for e in recorder.snapshot()][-1] == "engine_shutdown"


def test_a_scheduler_the_adapter_does_not_accept_runs_untouched(
    recorder: EventRecorder, models: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = models
    inst = OmlxInstrumentor(accept=lambda s: False)
    inst.instrument(pm=make_plugin_manager([recorder], settings=RecoverySettings(), entry_points_too=False))
    try:
        sched = make_scheduler(model, tokenizer, tmp_path / "other", CONFIG)
        serve(sched, make_request("x", contract_tokens(100), max_tokens=3, sparse=False))
        while sched.has_requests():
            sched.step()
        assert inst.engine(sched) is None and inst.attach(sched) is None
        sched.shutdown()
    finally:
        inst.uninstrument()
    assert recorder.snapshot() == []


def test_uninstrument_tells_plugins_their_engines_are_gone(
    recorder: EventRecorder, models: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = models
    inst = OmlxInstrumentor()
    inst.instrument(pm=make_plugin_manager([recorder], settings=RecoverySettings(), entry_points_too=False))
    sched = make_scheduler(model, tokenizer, tmp_path / "u", CONFIG)
    port = inst.attach(sched)
    inst.uninstrument()
    assert [(e.hook, e.engine_id) for e in recorder.snapshot()] == [
        ("engine_attached", port.engine_id),
        ("engine_shutdown", port.engine_id),
    ]
    sched.shutdown()


def test_the_omlx_adapter_is_found_through_its_entry_point_and_instruments(
    recorder: EventRecorder,
) -> None:
    adapters = load_host_adapters()
    assert isinstance(adapters["omlx"], HostAdapter)
    pm = make_plugin_manager([recorder], settings=RecoverySettings(), entry_points_too=False)
    try:
        report = instrument_installed_hosts(pm=pm)
        assert report.instrumented == ["omlx"]
        assert getattr(Scheduler.step, "__mlx_recovery_wrapper__", False)
    finally:
        uninstrument_all_hosts()
    assert not getattr(Scheduler.step, "__mlx_recovery_wrapper__", False)


def test_a_broken_adapter_entry_point_is_skipped_and_the_rest_load() -> None:
    group = "mlx_recovery_plugin.hosts"
    eps = [
        EntryPoint("broken-for-test", "no_such_module_anywhere:Adapter", group),
        EntryPoint("not-an-adapter-for-test", "builtins:dict", group),
    ]
    report = instrument_installed_hosts(
        pm=make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False), eps=eps
    )
    assert report.instrumented == [] and report.failed == {}
    assert "broken-for-test" not in load_host_adapters(eps=[])


def test_a_request_refused_at_the_door_departs_and_a_duplicate_id_is_reported_once(
    models: tuple[Any, Any], recorder: EventRecorder
) -> None:
    import asyncio

    from omlx.exceptions import SchedulerQueueFullError

    from mlx_recovery_plugin.events import DepartureReason
    from mlx_recovery_plugin.testing.omlx_host import OmlxContractHost

    model, tokenizer = models
    host = OmlxContractHost(model, tokenizer, plugins=[recorder])
    try:
        prompt = contract_tokens(90, seed=3)
        rid = host.submit(prompt)
        with pytest.raises(ValueError):  # oMLX refuses a second request with the same id
            asyncio.run(host.core.add_request(prompt, request_id=rid))
        assert recorder.hooks_for(rid) == ["request_arrived"]
        host.run_until_idle()
        # EngineCore answers a failed add_request by aborting that id: the first request.
        assert recorder.hooks_for(rid) == ["request_arrived", "request_aborted", "request_departed"]

        def queue_full(request: Any) -> None:
            raise SchedulerQueueFullError(current_depth=32, max_depth=32)

        host.scheduler.add_request = queue_full  # the engine thread's answer, this once
        try:
            with pytest.raises(SchedulerQueueFullError):
                asyncio.run(host.core.add_request(prompt, request_id="refused"))
        finally:
            del host.scheduler.add_request
        assert recorder.hooks_for("refused") == ["request_arrived", "request_departed"]
        assert recorder.one("request_departed", "refused").reason == DepartureReason.FAILED
        assert host.engine.queues_empty()
    finally:
        host.close()


def test_prefills_admitted_in_one_call_are_each_charged_their_own_part(
    instrumentor: OmlxInstrumentor, recorder: EventRecorder, models: tuple[Any, Any], tmp_path: Path
) -> None:
    """oMLX prefills the requests it admits in one step one after another: a short
    prompt admitted beside a long one is charged its own few hundred tokens, not half
    of the call (an even split would learn the short turn as dear as the long one)."""
    model, tokenizer = models
    sched = make_scheduler(model, tokenizer, tmp_path / "seq", CONFIG)
    instrumentor.attach(sched)
    started = time.perf_counter()  # from before their doors, which each one's time includes
    sched.add_request(make_request("short", contract_tokens(150, seed=5), max_tokens=2, sparse=False))
    sched.add_request(make_request("long", contract_tokens(2400, seed=6), max_tokens=2, sparse=False))
    sched.step()
    wall = time.perf_counter() - started
    assert {"short", "long"} <= set(sched.running), "both admitted in the one step"
    for _ in range(20):
        if not sched.has_requests():
            break
        sched.step()
    by_id = {e.request_id: e.prefill_s for e in recorder.prefills}
    assert set(by_id) == {"short", "long"}
    assert by_id["short"] < 0.5 * by_id["long"], by_id
    assert by_id["short"] + by_id["long"] <= wall, (by_id, wall)
    sched.shutdown()


@pytest.mark.parametrize("long_first", [False, True], ids=["short-first", "long-first"])
def test_a_chunked_prefill_admitted_beside_a_finished_one_is_charged_its_first_chunk(
    instrumentor: OmlxInstrumentor,
    recorder: EventRecorder,
    models: tuple[Any, Any],
    tmp_path: Path,
    long_first: bool,
) -> None:
    """In chunked mode oMLX runs a long prompt's first chunk in the call that admits it,
    beside a short prompt it finishes there. The call belongs to the two of them: their
    shares add up to the time from admission to the long one's first token, and the
    short one is not charged the long one's chunk (before, a chunk after the short one's
    stamp was charged to nobody, and one before it to the short one)."""
    model, tokenizer = models
    config = ServeConfig(model_id="tiny", block_size=64, prefill_step=512, sparse_threshold=4096, pool_blocks=256)
    sched = make_scheduler(model, tokenizer, tmp_path / "chunked", config)
    sched.config.chunked_prefill = True
    instrumentor.attach(sched)
    prompts = [("short", contract_tokens(100, seed=7)), ("long", contract_tokens(1100, seed=8))]
    # From before their doors: each one's time includes what oMLX did for it there.
    started = time.perf_counter()
    for rid, prompt in reversed(prompts) if long_first else prompts:
        sched.add_request(make_request(rid, prompt, max_tokens=2, sparse=False))
    sched.step()
    assert "short" in sched.running and [r.request_id for r in sched.prefilling] == ["long"]
    for _ in range(20):
        if any(e.request_id == "long" for e in recorder.prefills):
            break
        sched.step()
    wall = time.perf_counter() - started
    by_id = {e.request_id: e.prefill_s for e in recorder.prefills}
    assert set(by_id) == {"short", "long"}
    assert 0.9 * wall <= by_id["short"] + by_id["long"] <= wall, (by_id, wall)
    assert by_id["short"] < by_id["long"] / 3, by_id
    while sched.has_requests():
        sched.step()
    sched.shutdown()
