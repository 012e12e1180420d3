"""The host contract suite against the real oMLX scheduler, through the oMLX adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

omlx = pytest.importorskip(
    "omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests"
)

from mlx_recovery_plugin.testing.contract import HostContractSuite
from mlx_recovery_plugin.testing.omlx_host import OmlxContractHost
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model


@pytest.fixture(scope="module")
def models(tiny_llama_dir: Path, tiny_draft_dir: Path) -> tuple[Any, Any, Any]:
    model, tokenizer = load_tiny_model(tiny_llama_dir)
    draft, _ = load_tiny_model(tiny_draft_dir)
    return model, tokenizer, draft


class TestOmlxHostContract(HostContractSuite):
    @pytest.fixture
    def contract_host(self, models: tuple[Any, Any, Any]) -> Iterator[OmlxContractHost]:
        model, tokenizer, draft = models
        host = OmlxContractHost(model, tokenizer, draft, block_size=64, sparse_threshold=128)
        yield host
        host.close()
