"""Plugin loading: entry points, isolation of broken plugins, allow/block lists, hook calls."""

from __future__ import annotations

import logging
import sys
import threading
import types
from importlib.metadata import EntryPoint

import pytest

from mlx_recovery_plugin.events import IdleStep, PrefixLookup, RequestArrived
from mlx_recovery_plugin.hookspecs import hookimpl
from mlx_recovery_plugin.plugins import (
    ENTRY_POINT_GROUP,
    HookEmitter,
    PluginLoadError,
    load_entry_point_plugins,
    make_plugin_manager,
    new_plugin_manager,
)
from mlx_recovery_plugin.settings import RecoverySettings


class Recorder:
    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl
    def request_arrived(self, event: RequestArrived) -> None:
        self.seen.append(event.request_id)


class Exploding:
    @hookimpl
    def request_arrived(self, event: RequestArrived) -> None:
        raise RuntimeError("plugin bug")

    @hookimpl
    def engine_idle_step(self, event: IdleStep) -> bool:
        raise MemoryError("pretend OOM")


class Misspelled:
    @hookimpl
    def request_arived(self, event: RequestArrived) -> None:  # no such hook
        pass


@pytest.fixture
def fake_plugins_module(monkeypatch: pytest.MonkeyPatch) -> str:
    module = types.ModuleType("fake_mlx_recovery_plugins")
    module.Recorder = Recorder  # type: ignore[attr-defined]
    module.Misspelled = Misspelled  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def _arrival(rid: str) -> RequestArrived:
    return RequestArrived("e0", rid, "m", (1, 2, 3))


def test_broken_plugins_are_logged_and_skipped_while_good_ones_load(
    fake_plugins_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    pm = new_plugin_manager()
    eps = [
        _ep("good", f"{fake_plugins_module}:Recorder"),
        _ep("missing", "no_such_module_anywhere:Plugin"),
        _ep("misspelled", f"{fake_plugins_module}:Misspelled"),
    ]
    with caplog.at_level(logging.WARNING):
        report = load_entry_point_plugins(pm, RecoverySettings(), eps)
    assert report.loaded == ["good"]
    assert set(report.failed) == {"missing", "misspelled"}
    assert "request_arived" in report.failed["misspelled"]
    assert pm.get_plugin("misspelled") is None
    assert "no_such_module_anywhere" in caplog.text
    # The good plugin was instantiated from its class and receives events.
    HookEmitter(pm).emit("request_arrived", event=_arrival("r1"))
    assert pm.get_plugin("good").seen == ["r1"]


def test_allow_list_loads_only_named_plugins(fake_plugins_module: str) -> None:
    eps = [_ep("a", f"{fake_plugins_module}:Recorder"), _ep("b", f"{fake_plugins_module}:Recorder")]
    report = load_entry_point_plugins(new_plugin_manager(), RecoverySettings(plugins="b"), eps)
    assert report.loaded == ["b"] and report.skipped == ["a"]


def test_block_list_wins_over_allow_list(fake_plugins_module: str) -> None:
    eps = [_ep("a", f"{fake_plugins_module}:Recorder"), _ep("b", f"{fake_plugins_module}:Recorder")]
    settings = RecoverySettings(plugins="a,b", disable_plugins=" b ")
    report = load_entry_point_plugins(new_plugin_manager(), settings, eps)
    assert report.loaded == ["a"] and report.skipped == ["b"]


def test_explicit_plugin_with_unknown_hook_is_refused() -> None:
    with pytest.raises(PluginLoadError, match="request_arived"):
        make_plugin_manager([Misspelled()], settings=RecoverySettings(), entry_points_too=False)


def test_a_failing_plugin_never_raises_into_the_host_and_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    pm = make_plugin_manager([recorder, Exploding()], settings=RecoverySettings(), entry_points_too=False)
    emitter = HookEmitter(pm)
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            emitter.emit("request_arrived", event=_arrival(f"r{i}"))
        assert emitter.emit("engine_idle_step", event=IdleStep("e0", 1)) == []
    assert recorder.seen == ["r0", "r1", "r2"]
    assert emitter.errors == 4
    # Logged once per plugin, hook and kind of error, not once per call.
    assert caplog.text.count("failed in request_arrived") == 1
    assert caplog.text.count("failed in engine_idle_step") == 1


def test_firstresult_hook_returns_the_first_decision() -> None:
    class Declines:
        @hookimpl
        def prefix_lookup(self, lookup: PrefixLookup) -> None:
            return None

    class Decides:
        @hookimpl
        def prefix_lookup(self, lookup: PrefixLookup) -> str:
            return "decided"

    pm = make_plugin_manager([Decides(), Declines()], settings=RecoverySettings(), entry_points_too=False)
    lookup = PrefixLookup("e0", "r", "entry", 128, 100, 64)
    assert HookEmitter(pm).first("prefix_lookup", lookup=lookup) == "decided"
    assert HookEmitter(pm).emit("prefix_lookup", lookup=lookup) == ["decided"]


class Wrapping:
    @hookimpl(wrapper=True)
    def request_arrived(self, event: RequestArrived):  # type: ignore[no-untyped-def]
        return (yield)


def test_a_hook_wrapper_is_refused_with_the_reason_not_left_uncalled() -> None:
    with pytest.raises(PluginLoadError, match=r"hook wrappers are not supported.*request_arrived"):
        make_plugin_manager([Wrapping()], settings=RecoverySettings(), entry_points_too=False)


def test_a_misspelt_hook_name_is_logged_and_never_raises_into_the_host(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    emitter = HookEmitter(make_plugin_manager([recorder], settings=RecoverySettings(), entry_points_too=False))
    with caplog.at_level(logging.ERROR):
        assert emitter.emit("request_arived", event=_arrival("r1")) == []
    assert "no hook named 'request_arived'" in caplog.text
    emitter.request_arrived(_arrival("r2"))  # the typed call reaches the plugin
    assert recorder.seen == ["r2"]


class Exiting:
    @hookimpl
    def request_arrived(self, event: RequestArrived) -> None:
        raise SystemExit(3)


def test_a_plugin_raising_system_exit_never_reaches_the_host_and_the_others_still_run() -> None:
    recorder = Recorder()
    pm = make_plugin_manager([recorder, Exiting()], settings=RecoverySettings(), entry_points_too=False)
    emitter = HookEmitter(pm)
    emitter.request_arrived(_arrival("r1"))  # Exiting runs first (last registered)
    assert recorder.seen == ["r1"]
    assert emitter.errors == 1


def test_a_keyboard_interrupt_still_stops_the_process() -> None:
    class Interrupting:
        @hookimpl
        def request_arrived(self, event: RequestArrived) -> None:
            raise KeyboardInterrupt

    emitter = HookEmitter(make_plugin_manager([Interrupting()], settings=RecoverySettings(), entry_points_too=False))
    with pytest.raises(KeyboardInterrupt):
        emitter.request_arrived(_arrival("r1"))


def test_a_keyboard_interrupt_raised_on_an_engine_thread_never_reaches_the_host() -> None:
    """Ctrl-C lands on the main thread only: on a host's engine thread it is a plugin bug."""

    class Interrupting:
        @hookimpl
        def engine_idle_step(self, event: IdleStep) -> bool:
            raise KeyboardInterrupt

    class Answering:
        @hookimpl
        def engine_idle_step(self, event: IdleStep) -> float:
            return 0.5

    pm = make_plugin_manager([Answering(), Interrupting()], settings=RecoverySettings(), entry_points_too=False)
    emitter = HookEmitter(pm)
    outcome: list[object] = []

    def engine_thread() -> None:
        try:
            outcome.append(emitter.engine_idle_step(IdleStep("e1", 1)))
        except BaseException as exc:  # noqa: BLE001 - what the test looks for
            outcome.append(exc)

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join(timeout=10)
    assert outcome == [[0.5]] and emitter.errors == 1


def test_a_plugin_that_exits_while_loading_is_reported_and_the_rest_load(fake_plugins_module: str) -> None:
    module = sys.modules[fake_plugins_module]

    class ExitingFactory:
        def __init__(self) -> None:
            raise SystemExit("plugin called sys.exit while starting")

    module.ExitingFactory = ExitingFactory  # type: ignore[attr-defined]
    pm = new_plugin_manager()
    eps = [_ep("good", f"{fake_plugins_module}:Recorder"), _ep("exits", f"{fake_plugins_module}:ExitingFactory")]
    report = load_entry_point_plugins(pm, RecoverySettings(), eps=eps)
    assert report.loaded == ["good"]
    assert report.failed["exits"].startswith("SystemExit")


def test_a_plugin_list_entry_that_names_no_plugin_is_warned_about(
    fake_plugins_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    eps = [_ep("recovery", f"{fake_plugins_module}:Recorder")]
    with caplog.at_level(logging.WARNING):
        report = load_entry_point_plugins(new_plugin_manager(), RecoverySettings(plugins="recovry"), eps=eps)
    assert report.loaded == []
    assert "MLX_RECOVERY_PLUGINS names 'recovry', which is no installed plugin (installed: recovery)" in caplog.text
