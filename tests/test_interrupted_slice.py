"""An arrival in the middle of a slice on a many-layer model: the passes the slice had
finished are kept, the next slice goes on from them, and nothing is computed twice but
the one pass the arrival stopped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.runner import SliceRunner
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock, random_tokens
from mlx_recovery_plugin.testing.host import MockHost
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model

B = 64
SLICE = 4 * B  # run in four passes of one block each
MODEL = "tiny-deep"


class CountingModel:
    """The model as the runner sees it: counts the tokens of every forward pass and calls
    ``before`` with the pass's number first."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens: list[int] = []
        self.before: Callable[[int], None] | None = None

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        self.tokens.append(int(inputs.shape[1]))
        if self.before is not None:
            self.before(len(self.tokens))
        return self.inner(inputs, cache=cache)

    def parameters(self) -> Any:
        return self.inner.parameters()


class CountingHandle:
    def __init__(self, inner: Any, model: CountingModel) -> None:
        self.model_id, self.stream, self.model = inner.model_id, inner.stream, model
        self._inner = inner

    def make_cache(self) -> list[Any]:
        return list(self._inner.make_cache())


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory, tiny_draft_dir: Path) -> tuple[Any, Any, Any]:
    """An 8-layer tiny llama: many stop points per pass, like a real model."""
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-deep"), TinyModelSpec(num_layers=8, seed=11))
    model, tokenizer = load_tiny_model(path)
    draft, _ = load_tiny_model(tiny_draft_dir)
    return model, tokenizer, draft


def test_an_arrival_mid_slice_keeps_the_finished_passes_and_the_job_resumes_after_them(deep) -> None:
    model, tokenizer, draft = deep
    # Publication mechanics on partial prefixes: the auto policy would hold a partial
    # prefix under a next turn that stays sparse.
    settings = RecoverySettings(
        budget_pct=50.0, idle_steps=2, slice_tokens=SLICE, models={MODEL: {"enabled": True}},
        publish_policy="always",
    )
    counting = CountingModel(model)
    begun: list[int] = []

    class Runner(SliceRunner):
        def begin(self, tokens: Any, prefix: Any = None) -> Any:
            begun.append(prefix.tokens if prefix is not None else 0)
            return super().begin(tokens, prefix)

    def factory(handle: Any, block_size: int, interruptible: bool) -> SliceRunner:
        return Runner(CountingHandle(handle, counting), block_size, interruptible=interruptible, stop_grain=B)

    plugin = RecoveryPlugin(settings, clock=FakeClock(1000.0), runner_factory=factory, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=settings, entry_points_too=False))
    host.add_engine(
        "e", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
        block_size=B, prefill_step=128, sparse_threshold=16,
    )
    try:
        prompt = random_tokens(50, 700)  # 640 tokens in whole blocks to recover
        rid = host.submit("e", prompt, sparse=True, max_tokens=2)
        host.run_until_idle()
        assert host.result(rid).route == "sparse"

        # Passes: 1 is the first slice (one block, no rate known yet); 2-5 the second
        # slice's four. The arrival comes as pass 4 begins: passes 2 and 3 are finished.
        arrivals: list[str] = []

        def arrive(n: int) -> None:
            if n == 4:
                arrivals.append(host.submit("e", random_tokens(51, 100), max_tokens=2))

        counting.before = arrive
        host.drive_idle()
        status = plugin.status()["engines"]["e"]
        assert status["counters"]["slices_interrupted"] == 1
        assert status["live_offset"] is None  # retired for the foreground, as ever
        (job,) = status["jobs"]
        assert job["committed"] == B

        counting.before = None
        host.run_until_idle()
        host.drive_idle()
        assert plugin.status()["engines"]["e"]["jobs"] == []
        assert begun[-1] == 3 * B  # went on after the kept passes, not from the committed block
        assert host.engines["e"].prefix_cache.stored_tokens(prompt) == 640
        # Every token once, plus the one pass the arrival stopped (today's runner redid
        # the finished passes as well).
        assert counting.tokens[:4] == [B, B, B, B]
        assert sum(counting.tokens) == 640 + B
    finally:
        plugin.close()
    assert host.leaked() == {}

    # The blocks kept from the interrupted slice restore the dense answer.
    cold = MockHost(make_plugin_manager([], settings=settings, entry_points_too=False))
    cold.add_engine("c", model=model, tokenizer=tokenizer, block_size=B, prefill_step=128)
    follow = prompt + random_tokens(52, 40)
    warm_rid = host.submit("e", follow, sparse=False, max_tokens=4)
    host.run_until_idle()
    cold_rid = cold.submit("c", follow, max_tokens=4)
    cold.run_until_idle()
    warm = host.result(warm_rid)
    assert warm.cached_tokens == 640
    assert warm.output_tokens == cold.result(cold_rid).output_tokens
