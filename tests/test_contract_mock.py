"""The host contract suite, run against the mock host (its reference implementation)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pluggy
import pytest

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.testing import MockEngine, MockHost, RequestResult
from mlx_recovery_plugin.testing.contract import (
    ContractHost,
    HostContractSuite,
    ThreadedContractHost,
)

pytest_plugins = ["pytester"]

BLOCK = 16


class MockContractHost:
    """:class:`ContractHost` over one engine of a :class:`MockHost`."""

    supports_sparse_route = True
    supports_abort_all = True
    supports_fail_all = True
    supports_threads = True
    serves_sparse_one_at_a_time = True
    tells_of_lookups = True

    def __init__(self, model_dir: Path, draft_dir: Path, cache_kind: str = "paged") -> None:
        self.host = MockHost(make_plugin_manager(entry_points_too=False))
        self._engine = self.host.add_engine(
            "contract", model_dir, block_size=BLOCK, prefill_step=32,
            draft_model_dir=draft_dir, sparse_threshold=2 * BLOCK, model_id="tiny/llama-1.0",
            cache_kind=cache_kind,
        )

    @property
    def block_size(self) -> int:
        return BLOCK

    @property
    def sparse_threshold(self) -> int:
        return self._engine.sparse_threshold

    @property
    def engine(self) -> MockEngine:
        return self._engine

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self.host.pm

    def submit(self, prompt_tokens: Sequence[int], *, max_tokens: int = 4, sparse: bool = False) -> str:
        return self.host.submit("contract", prompt_tokens, max_tokens=max_tokens, sparse=sparse)

    def run_until_idle(self) -> None:
        self.host.run_until_idle()

    def drive_idle(self, max_steps: int = 100) -> int:
        return self.host.drive_idle(max_steps)

    def abort(self, request_id: str) -> None:
        self.host.abort(request_id)

    def abort_all(self) -> None:
        self.host.abort_all("contract")

    def fail_all(self, error: str) -> None:
        self.host.fail_all("contract", error)

    def reset(self, deep: bool = False) -> None:
        self.host.reset("contract", deep=deep)

    def shutdown(self) -> None:
        self.host.shutdown("contract")

    def unload(self) -> None:
        self.host.unload("contract")

    def result(self, request_id: str) -> RequestResult:
        return self.host.result(request_id)

    def outstanding_refs(self) -> Mapping[str, Any]:
        return self.host.outstanding_refs()["contract"]

    def step_count(self) -> int:
        return self._engine.step_count

    def start(self) -> None:
        self.host.start()

    def stop(self) -> None:
        self.host.stop()

    def wait(self, request_id: str, timeout: float) -> RequestResult:
        return self.host.wait(request_id, timeout)


class TestMockHostContract(HostContractSuite):
    """Both kinds of prefix cache: oMLX's paged blocks and rapid-mlx's whole entries."""

    @pytest.fixture(params=["paged", "entries"])
    def contract_host(
        self, request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_draft_dir: Path
    ) -> Iterator[MockContractHost]:
        host = MockContractHost(tiny_llama_dir, tiny_draft_dir, cache_kind=request.param)
        yield host
        host.host.stop()


def test_mock_adapter_satisfies_the_contract_protocols(tiny_llama_dir: Path, tiny_draft_dir: Path) -> None:
    host = MockContractHost(tiny_llama_dir, tiny_draft_dir)
    assert isinstance(host, ContractHost)
    assert isinstance(host, ThreadedContractHost)


def test_suite_loads_as_an_opt_in_pytest_plugin(pytester: pytest.Pytester) -> None:
    """``pytest -p mlx_recovery_plugin.testing.contract`` gives a module the recorder fixture."""
    pytester.makepyfile(test_plugin_use=textwrap.dedent("""
        import pytest
        from mlx_recovery_plugin.events import RequestArrived
        from mlx_recovery_plugin.plugins import make_plugin_manager

        class FakeHost:
            def __init__(self):
                self.plugin_manager = make_plugin_manager(entry_points_too=False)
                self.engine = type("E", (), {"engine_id": "e", "queues_empty": lambda s: True})()

        @pytest.fixture
        def contract_host():
            return FakeHost()

        def test_recorder_sees_events(contract_host, event_recorder):
            contract_host.plugin_manager.hook.request_arrived(
                event=RequestArrived("e", "r1", "m", (1, 2)))
            assert event_recorder.hooks_for("r1") == ["request_arrived"]

        def test_tokens_are_deterministic_bytes():
            from mlx_recovery_plugin.testing.contract import contract_tokens
            assert contract_tokens(300, 1) == contract_tokens(300, 1)
            assert max(contract_tokens(300, 1)) < 256
    """))
    outcome = pytester.runpytest_inprocess("-p", "mlx_recovery_plugin.testing.contract")
    outcome.assert_outcomes(passed=2)
