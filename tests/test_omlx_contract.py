"""The host contract suite against the real scheduler of each oMLX family member
(flyto-mlx, fusion-mlx), through the family adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.hosts.omlx.members import Member
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
    def contract_host(self, models: tuple[Any, Any, Any], omlx_member: Member) -> Iterator[OmlxContractHost]:
        model, tokenizer, draft = models
        host = OmlxContractHost(model, tokenizer, draft, block_size=64, sparse_threshold=128, member=omlx_member)
        yield host
        host.close()
