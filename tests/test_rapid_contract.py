"""The host contract suite against the real rapid-mlx scheduler, through the rapid-mlx
adapter (its whole-entry prefix cache, PFlash as the sparse route)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAPID_MLX_TELEMETRY", "0")
pytest.importorskip("rapid_mlx.scheduler", reason="rapid-mlx is not installed; CI installs it in .venv-rapid")

from mlx_recovery_plugin.testing.contract import HostContractSuite, ThreadedContractHost
from mlx_recovery_plugin.testing.rapid_host import RapidContractHost
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(tiny_llama_dir)


class TestRapidHostContract(HostContractSuite):
    @pytest.fixture
    def contract_host(self, models: tuple[Any, Any]) -> Iterator[RapidContractHost]:
        model, tokenizer = models
        host = RapidContractHost(model=model, tokenizer=tokenizer, block_size=64)
        yield host
        host.close()


def test_rapid_adapter_satisfies_the_contract_protocols(models: tuple[Any, Any]) -> None:
    model, tokenizer = models
    host = RapidContractHost(model=model, tokenizer=tokenizer, block_size=64)
    try:
        assert isinstance(host, ThreadedContractHost)
    finally:
        host.close()
