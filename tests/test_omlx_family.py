"""The oMLX family: one adapter class, bound per member to data, found through one entry
point per member; each installed member's data names what really is in its package."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

import pytest

from mlx_recovery_plugin.hosts import HostAdapter, load_host_adapters
from mlx_recovery_plugin.hosts.omlx import FLYTO_MLX, FUSION_MLX, MEMBERS, Member, OmlxInstrumentor, member_of
from mlx_recovery_plugin.hosts.omlx.instrumentor import SCHEDULER_NEEDS, iter_wrapped, version_supported
from mlx_recovery_plugin.hosts.omlx.wrappers import FACTORIES
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings


def test_each_member_has_an_adapter_entry_point_bound_to_it_and_names_its_package() -> None:
    adapters = load_host_adapters()
    for name, member in MEMBERS.items():
        adapter = adapters[name]
        assert isinstance(adapter, HostAdapter) and isinstance(adapter, OmlxInstrumentor)
        assert adapter.member is member
        assert (adapter.name, adapter.trigger_module) == (name, member.scheduler_module)
        assert member.scheduler_module in adapter.startup_hooks()
    packages = {ep.name: ep.value for ep in entry_points(group="mlx_recovery_plugin.host_packages")}
    assert {name: packages.get(name) for name in MEMBERS} == {"omlx": "omlx", "fusion_mlx": "fusion_mlx"}


def test_versions_are_gated_per_member() -> None:
    assert version_supported("0.7.0", FLYTO_MLX) and not version_supported("0.10.24", FLYTO_MLX)
    assert version_supported("0.10.24", FUSION_MLX) and not version_supported("0.7.0", FUSION_MLX)
    assert not version_supported("0.11.0", FUSION_MLX) and not version_supported("0.9.9", FUSION_MLX)


def test_an_adapter_whose_member_is_missing_reports_it_not_importable() -> None:
    ghost = Member(**{**{f: getattr(FUSION_MLX, f) for f in FUSION_MLX.__slots__}, "package": "no_such_host_pkg"})  # type: ignore[arg-type]
    assert not OmlxInstrumentor(ghost).host_importable()


def _class_state(member: Member) -> dict[str, Any]:
    classes = (member.scheduler_class(), member.engine_core_class())
    return {f"{cls.__name__}.{name}": cls.__dict__.get(name) for cls in classes for name in dir(cls)}


@pytest.mark.parametrize("shift", ["older", "newer"])
def test_an_unknown_version_of_an_installed_member_is_refused_with_one_clear_line(
    omlx_member: Member, shift: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    low, high = omlx_member.versions.low, omlx_member.versions.high
    version = ".".join(map(str, (low[0], low[1] - 1, 9) if shift == "older" else high + (0,)))
    monkeypatch.setattr(omlx_member.resolve(omlx_member.version_module), "__version__", version)
    before = _class_state(omlx_member)
    inst = OmlxInstrumentor(omlx_member)
    with caplog.at_level(logging.WARNING):
        assert not inst.instrument(pm=make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False))
    assert not inst.is_instrumented and _class_state(omlx_member) == before
    assert f"{omlx_member.label} {version} is not supported (this adapter knows {omlx_member.versions})" in caplog.text


def test_the_installed_member_has_everything_its_data_names(omlx_member: Member) -> None:
    from packaging.version import Version

    assert Version(omlx_member.version()) >= Version(".".join(map(str, omlx_member.versions.low)))
    lock = omlx_member.host_buffer_lock()
    assert lock is not None and callable(lock.acquire) and callable(lock.release)
    with lock, lock:  # re-entrant, as the port's store relies on
        pass
    assert isinstance(omlx_member.resolve(omlx_member.scheduler_output)(), object)
    assert hasattr(omlx_member.resolve(omlx_member.engine_pool_module), "EnginePool")
    threshold, keep = omlx_member.sparse_defaults()
    assert threshold == 8192 and keep == pytest.approx(0.2)
    classes = {"Scheduler": omlx_member.scheduler_class(), "EngineCore": omlx_member.engine_core_class()}
    for cls_name, method in [*FACTORIES, *(("Scheduler", n) for n in SCHEDULER_NEEDS)]:
        assert callable(getattr(classes[cls_name], method)), f"{cls_name}.{method}"
    config = omlx_member.resolve(omlx_member.scheduler_module).SchedulerConfig(
        **omlx_member.scheduler_cache_config("/tmp/unused")
    )
    assert config is not None


def test_instrumenting_one_member_wraps_its_classes_and_uninstrument_restores_them(omlx_member: Member) -> None:
    classes = (omlx_member.scheduler_class(), omlx_member.engine_core_class())
    before = _class_state(omlx_member)
    inst = OmlxInstrumentor(omlx_member)
    assert inst.instrument(pm=make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False))
    try:
        assert len(iter_wrapped(classes)) == len(FACTORIES)
        assert inst.version == omlx_member.version()
    finally:
        inst.uninstrument()
    assert iter_wrapped(classes) == [] and _class_state(omlx_member) == before


def test_a_scheduler_is_recognised_as_its_members(omlx_member: Member, tmp_path: Any, tiny_llama_dir: Any) -> None:
    from mlx_recovery_plugin.demo.arms import ServeConfig
    from mlx_recovery_plugin.demo.omlx import make_scheduler
    from mlx_recovery_plugin.testing.tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(tiny_llama_dir)
    config = ServeConfig(model_id="tiny", block_size=64, prefill_step=128, sparse_threshold=1024, pool_blocks=64)
    scheduler = make_scheduler(model, tokenizer, tmp_path / "cache", config, member=omlx_member)
    try:
        assert member_of(scheduler) is omlx_member
        assert scheduler.block_aware_cache is not None  # the member's cache switch turned it on
    finally:
        scheduler.shutdown()
