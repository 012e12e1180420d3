"""The host contract suite against mlx-lm's own server classes, in process, through the
mlx-lm adapter: tiny random-weight float32 models loaded by the server with
``mlx_lm.load``, one per kind of prompt cache (the hybrid gets cuts, snapshots and
adoption; the reference model is left to mlx-lm's own trimming)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlx_recovery_plugin.hosts.mlx_lm.instrumentor import mlx_lm_version, version_supported
from mlx_recovery_plugin.testing.contract import ContractHost, EventRecorder, HostContractSuite, contract_tokens
from mlx_recovery_plugin.testing.mlx_lm_host import MlxLmContractHost
from mlx_recovery_plugin.testing.mlx_lm_models import SPECS
from mlx_recovery_plugin.testing.tiny_model import cached_model_dir

if not version_supported(mlx_lm_version()):
    pytest.skip("an mlx-lm version the adapter refuses", allow_module_level=True)

BLOCK = 64


@pytest.fixture(params=["hybrid", "reference"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestMlxLmHostContract(HostContractSuite):
    @pytest.fixture
    def contract_host(self, kind: str) -> Iterator[MlxLmContractHost]:
        host = MlxLmContractHost(cached_model_dir(SPECS[kind]), block_size=BLOCK)
        host.kind = kind  # type: ignore[attr-defined]
        yield host
        host.close()

    def test_a_partial_match_the_host_cannot_reuse_asks_one_lookup(
        self, contract_host: ContractHost, event_recorder: EventRecorder
    ) -> None:
        if kind_of(contract_host) == "reference":
            pytest.skip("a trimmable model: mlx-lm trims a copy itself and asks nothing")
        super().test_a_partial_match_the_host_cannot_reuse_asks_one_lookup(contract_host, event_recorder)


def kind_of(host: ContractHost) -> str:
    return str(getattr(host, "kind", ""))


def test_the_adopter_restores_the_block_floor_of_a_partial_match_on_the_hybrid() -> None:
    host = MlxLmContractHost(cached_model_dir(SPECS["hybrid"]), block_size=BLOCK)
    try:
        prompt = contract_tokens(int(3.5 * BLOCK), seed=60)
        first = host.submit(prompt)
        host.run_until_idle()
        shared = 2 * BLOCK + 20
        second = host.submit(prompt[:shared] + contract_tokens(BLOCK, seed=61))
        host.run_until_idle()
        assert host.result(first).cached_tokens == 0
        assert host.result(second).cached_tokens == 2 * BLOCK
        assert not host.outstanding_refs()
    finally:
        host.close()
