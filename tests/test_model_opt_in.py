"""A model id that misses its opt-in by a typo is said, once per engine, with the near
match (issue 22, 11)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.host import MockHost

LOGGER = "mlx_recovery_plugin.recovery.plugin"


@pytest.fixture
def attach(loaded: tuple[Any, Any, Any]) -> Iterator[Any]:
    model, tokenizer, _ = loaded
    plugins: list[RecoveryPlugin] = []

    def make(models: dict[str, Any], engines: list[tuple[str, str]]) -> RecoveryPlugin:
        settings = RecoverySettings(budget_pct=50.0, models=models)
        plugin = RecoveryPlugin(settings, control_socket=False)
        plugins.append(plugin)
        host = MockHost(make_plugin_manager([plugin], settings=settings, entry_points_too=False))
        for engine_id, model_id in engines:
            host.add_engine(engine_id, model=model, tokenizer=tokenizer, model_id=model_id, block_size=32, prefill_step=64)
        return plugin

    yield make
    for plugin in plugins:
        plugin.close()


def test_a_case_typo_in_the_opt_in_is_logged_with_the_near_match(attach: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plugin = attach({"Tiny": {"enabled": True}}, [("e", "tiny")])
    lines = [r.getMessage() for r in caplog.records if "not opted in" in r.getMessage()]
    assert len(lines) == 1
    assert "'tiny'" in lines[0] and "did you mean 'Tiny'" in lines[0]
    assert plugin.status()["not_opted_in"] == {"e": {"model_id": "tiny", "near_match": "Tiny"}}


def test_it_is_said_once_per_engine_not_per_attach(attach: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plugin = attach({"Tiny": {"enabled": True}}, [("e1", "tiny"), ("e2", "tiny")])
        service = plugin.service("e1")
        assert service is not None
        plugin.engine_attached(service.port)  # the same engine again (a host restart of it)
    lines = [r.getMessage() for r in caplog.records if "not opted in" in r.getMessage()]
    assert sorted(line.split()[2] for line in lines) == ["e1", "e2"]


def test_nothing_is_said_when_the_model_is_opted_in_or_no_model_is(attach: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        opted = attach({"tiny": {"enabled": True}}, [("e", "tiny")])
        none = attach({}, [("f", "tiny")])
    assert "not opted in" not in caplog.text
    assert opted.status()["not_opted_in"] == {} and none.status()["not_opted_in"] == {}


def test_an_unrelated_model_is_said_without_a_guess(attach: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plugin = attach({"org/llama-70b": {"enabled": True}}, [("e", "tiny")])
    assert "not opted in" in caplog.text and "did you mean" not in caplog.text
    assert plugin.status()["not_opted_in"]["e"]["near_match"] is None
