"""Parity on a trained model: SmolLM2-135M-Instruct with its own chat template. A turn
that takes the sparse route is recovered in idle time; the next turn restores the
recovered blocks and gets the greedy answer and the logits of a cold dense run, through
the mock host and through the real oMLX scheduler.

The tolerance on logits (float32): recovered blocks are prefilled in other chunks than a
cold run's, which changes only the order of float32 sums. Measured on this model, that
moves no logit by more than 3.5e-5 (logits reach ~40, so ~1e-6 relative); ``LOGIT_TOL``
is ~30 times that, and still over four orders of magnitude below what the sparse route
changes (the test measures that too, so the tolerance is shown to tell them apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import ModelSettings, RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock
from mlx_recovery_plugin.testing.host import MockHost
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model

BLOCK = 64
STEP = 128
THRESHOLD = 128  # uncached tokens above which a turn takes the sparse route
MAX_TOKENS = 8
LOGIT_TOL = 1e-3
MODEL_ID = "smollm2"

DRAWERS = ["red key", "blue cup", "green pen", "old map", "small box", "silver coin", "brass bell", "paper kite"]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(smollm2_dir)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A small random draft on SmolLM2's vocabulary: it only scores which tokens the
    sparse route keeps, and a small one keeps the tests short."""
    spec = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=49152, seed=3)
    return load_tiny_model(write_tiny_model(tmp_path_factory.mktemp("smol-draft"), spec))[0]


def conversation(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Two turns with SmolLM2's chat template: a passage and a question, then the answer
    and another question. The second prompt starts with the first."""
    facts = " ".join(f"The {thing} is in drawer {3 + i * 5 % 11}." for i, thing in enumerate(DRAWERS * 3))
    first = [
        {"role": "system", "content": "You answer questions about this inventory. " + facts},
        {"role": "user", "content": "Where is the blue cup?"},
    ]
    second = first + [
        {"role": "assistant", "content": "The blue cup is in drawer 8."},
        {"role": "user", "content": "Where is the old map?"},
    ]
    p1 = list(tokenizer.apply_chat_template(first, add_generation_prompt=True))
    p2 = list(tokenizer.apply_chat_template(second, add_generation_prompt=True))
    assert p2[: len(p1)] == p1 and len(p1) > THRESHOLD + BLOCK
    return p1, p2


def cold_dense(model: Any, tokenizer: Any, prompt: Sequence[int], chunk: int = 100) -> tuple[list[int], mx.array]:
    """Greedy tokens and first-token logits of plain mlx-lm over a fresh cache, prefilled
    in chunks unlike either host's."""
    cache = make_prompt_cache(model)
    for start in range(0, len(prompt) - 1, chunk):
        model(mx.array(prompt[start : min(start + chunk, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1]
    first = logits
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        if token in tokenizer.eos_token_ids:
            break
        logits = model(mx.array([token])[None], cache=cache)[0, -1]
    return tokens, first


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())


# -- the mock host -------------------------------------------------------------------------


def _mock_host(model: Any, tokenizer: Any, draft: Any, plugins: list[object]) -> MockHost:
    host = MockHost(make_plugin_manager(plugins, settings=RecoverySettings(), entry_points_too=False))
    host.add_engine(
        "e", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL_ID,
        block_size=BLOCK, prefill_step=STEP, sparse_threshold=THRESHOLD,
    )
    return host


def _serve(host: MockHost, prompt: Sequence[int]) -> Any:
    rid = host.submit("e", prompt, sparse=True, max_tokens=MAX_TOKENS)
    host.run_until_idle()
    return host.result(rid)


def test_recovered_blocks_give_smollm2_the_cold_dense_answer_on_the_mock_host(
    smol: tuple[Any, Any], draft: Any
) -> None:
    model, tokenizer = smol
    p1, p2 = conversation(tokenizer)
    plugin = RecoveryPlugin(
        RecoverySettings(budget_pct=50.0, idle_steps=2, models={MODEL_ID: ModelSettings(enabled=True)}),
        clock=FakeClock(1000.0), control_socket=False,
    )
    recovered = _mock_host(model, tokenizer, draft, [plugin])
    sparse_only = _mock_host(model, tokenizer, draft, [])
    try:
        first = _serve(recovered, p1)
        assert first.route == "sparse" and first.cached_tokens == 0
        recovered.drive_idle()
        again = _serve(recovered, p2)
        alone = _serve(sparse_only, p1), _serve(sparse_only, p2)
    finally:
        plugin.close()
    assert recovered.leaked() == {} and sparse_only.leaked() == {}

    tokens, logits = cold_dense(model, tokenizer, p2)
    # The restored prefix leaves less than the threshold uncached: the dense route.
    assert again.route == "dense" and again.cached_tokens == len(p1) // BLOCK * BLOCK
    assert list(again.output_tokens) == tokens
    assert max_diff(again.first_logits, logits) <= LOGIT_TOL
    # Without recovery the same turn is sparse again, and its logits are far outside it.
    assert alone[1].route == "sparse" and alone[1].cached_tokens == 0
    assert max_diff(alone[1].first_logits, logits) > 100 * LOGIT_TOL


# -- the real oMLX scheduler -----------------------------------------------------------------


def test_recovered_blocks_give_smollm2_the_cold_dense_answer_on_the_omlx_scheduler(
    smol: tuple[Any, Any], draft: Any, tmp_path: Path, omlx_member: Any
) -> None:
    from mlx_recovery_plugin.demo.arms import ServeConfig
    from mlx_recovery_plugin.demo.omlx import OmlxArm
    from mlx_recovery_plugin.hosts.omlx.ports import OmlxEngine
    from mlx_recovery_plugin.kvcodec import cache_from_blocks

    model, tokenizer = smol
    p1, p2 = conversation(tokenizer)
    config = ServeConfig(
        model_id=MODEL_ID, block_size=BLOCK, prefill_step=STEP, sparse_threshold=THRESHOLD,
        max_tokens=MAX_TOKENS, budget_pct=50.0, pool_blocks=256,
    )
    arm = OmlxArm("sparse_recovery", model, tokenizer, draft, config, tmp_path / "rec", member=omlx_member)
    try:
        first = arm.serve(p1, 0)
        assert first.row.route == "sparse" and first.row.cached_tokens == 0
        arm.think(30.0)
        again = arm.serve(p2, 1)

        # The blocks oMLX now holds, fetched through its own cache, continue like cold.
        port = OmlxEngine(arm.scheduler, "parity-probe").prefix_cache
        fetched = port.fetch("parity-probe", p2)
        try:
            cache = cache_from_blocks(lambda: make_prompt_cache(model), fetched.blocks)
            restored = model(mx.array(p2[fetched.tokens :])[None], cache=cache)[0, -1]
            mx.eval(restored)
        finally:
            port.release("parity-probe")
    finally:
        arm.close()  # raises if any block reference was left behind

    tokens, logits = cold_dense(model, tokenizer, p2)
    assert again.row.route == "dense" and again.row.cached_tokens == len(p1) // BLOCK * BLOCK
    assert again.output_tokens == tokens
    assert fetched.tokens >= again.row.cached_tokens
    assert max_diff(restored, logits) <= LOGIT_TOL
