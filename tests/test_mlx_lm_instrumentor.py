"""The mlx-lm adapter attaches and detaches exactly, refuses versions it does not know,
and its start-up hook waits for mlx-lm's server, not for mlx-lm."""

from __future__ import annotations

from typing import Any

import pytest

from hooked_python import run_python
from mlx_recovery_plugin.hosts.mlx_lm import MlxLmInstrumentor
from mlx_recovery_plugin.hosts.mlx_lm import instrumentor as instrumentor_module
from mlx_recovery_plugin.hosts.mlx_lm.cuts import is_cut, plan_cuts
from mlx_recovery_plugin.plugins import new_plugin_manager
from mlx_recovery_plugin.settings import RecoverySettings

pytestmark = pytest.mark.skipif(
    not instrumentor_module.version_supported(instrumentor_module.mlx_lm_version()),
    reason="mlx-lm version the adapter refuses",
)

WRAPPED = [
    ("mlx_lm.models.cache", "LRUPromptCache", "insert_cache"),
    ("mlx_lm.models.cache", "LRUPromptCache", "fetch_nearest_cache"),
    ("mlx_lm.server", "ResponseGenerator", "__init__"),
    ("mlx_lm.server", "ResponseGenerator", "_tokenize"),
    ("mlx_lm.server", "ResponseGenerator", "_serve_single"),
    ("mlx_lm.server", "ResponseGenerator", "_next_request"),
    ("mlx_lm.server", "ResponseGenerator", "stop_and_join"),
    ("mlx_lm.generate", "BatchGenerator", "insert_segments"),
    ("mlx_lm.generate", "BatchGenerator", "next"),
    ("mlx_lm.generate", "BatchGenerator", "remove"),
    ("mlx_lm.server", "APIHandler", "do_GET"),
]


def own_attributes() -> dict[tuple[str, str], Any]:
    import importlib

    out = {}
    for module, cls_name, _ in WRAPPED:
        cls = getattr(importlib.import_module(module), cls_name)
        for name, value in vars(cls).items():
            out[(cls_name, name)] = value
    return out


def test_uninstrument_puts_back_every_wrapped_attribute_as_the_identical_object() -> None:
    before = own_attributes()
    instrumentor = MlxLmInstrumentor(RecoverySettings(adopter_enabled=True))
    assert instrumentor.instrument(pm=new_plugin_manager())
    during = own_attributes()
    changed = {key for key in before if during[key] is not before[key]}
    assert changed == {(cls, name) for _, cls, name in WRAPPED}
    instrumentor.uninstrument()
    after = own_attributes()
    assert after.keys() == before.keys()
    assert all(after[key] is before[key] for key in before)


def test_instrument_twice_wraps_once_and_uninstrument_twice_is_harmless() -> None:
    instrumentor = MlxLmInstrumentor(RecoverySettings(adopter_enabled=True))
    try:
        assert instrumentor.instrument(pm=new_plugin_manager())
        first = own_attributes()
        assert instrumentor.instrument(pm=new_plugin_manager())
        assert all(own_attributes()[key] is value for key, value in first.items())
    finally:
        instrumentor.uninstrument()
        instrumentor.uninstrument()
    assert not instrumentor.is_instrumented


def test_an_unknown_mlx_lm_version_is_refused_with_nothing_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    before = own_attributes()
    monkeypatch.setattr(instrumentor_module, "mlx_lm_version", lambda: "0.31.3")
    instrumentor = MlxLmInstrumentor(RecoverySettings(adopter_enabled=True))
    assert not instrumentor.instrument(pm=new_plugin_manager())
    assert not instrumentor.is_instrumented
    assert all(own_attributes()[key] is value for key, value in before.items())


def test_cuts_fall_on_block_multiples_inside_segments_only() -> None:
    segments = [list(range(40)), list(range(40, 100))]  # the host's own boundary at 40
    new, types, cuts = plan_cuts(segments, ["system", "user"], 32)
    assert cuts == [32, 64, 96]
    assert [len(s) for s in new] == [32, 8, 24, 32, 4]
    assert types == ["assistant", "system", "assistant", "assistant", "user"]
    assert [is_cut(t) for t in types] == [True, False, True, True, False]
    assert [t for s in new for t in s] == list(range(100))


def test_no_cut_within_the_last_two_tokens_nor_where_skip_says_so() -> None:
    assert plan_cuts([list(range(65))], ["assistant"], 32, skip=lambda p: p == 32)[2] == []
    assert plan_cuts([list(range(66))], ["assistant"], 32)[2] == [32, 64]


def test_importing_mlx_lm_alone_wraps_nothing_and_the_server_module_attaches() -> None:
    out = run_python(
        """
        import mlx_lm, sys
        from mlx_lm.models import cache
        plain = [hasattr(getattr(cache.LRUPromptCache, n), "__mlx_recovery_wrapper__")
                 for n in ("insert_cache", "fetch_nearest_cache")]
        server_before = "mlx_lm.server" in sys.modules
        import mlx_lm.server
        served = [hasattr(getattr(cache.LRUPromptCache, n), "__mlx_recovery_wrapper__")
                  for n in ("insert_cache", "fetch_nearest_cache")]
        tokenize = hasattr(mlx_lm.server.ResponseGenerator._tokenize, "__mlx_recovery_wrapper__")
        print(json.dumps({"plain": plain, "server_before": server_before, "served": served, "tokenize": tokenize}))
        """,
        MLX_RECOVERY_ENABLE="1", MLX_RECOVERY_ADOPTER_ENABLED="1",
    )
    assert out == {"plain": [False, False], "server_before": False, "served": [True, True], "tokenize": True}
