"""Hybrid models on the real scheduler of each oMLX family member: what recovery
publishes, and what a later turn restores.

What really happens (flyto-mlx 0.7.0, fusion-mlx 0.10.24):

- lfm2-shaped (short-convolution layers, one recurrent array each, and attention): the
  host's prefix cache keeps a recurrent layer's state only when it has two arrays (conv
  and SSM, the GDN / Mamba shape); lfm2's one-array conv state is stored as a placeholder,
  and every restore that ends on one is rejected ("partial prefix match detected ...
  Rejecting cache"). The host restores no lfm2 prefix at all, dense route included, so
  recovery cannot fix the upstream report (hybrid model + SpecPrefill: 0 cached tokens on
  every turn) there: it publishes through the host's own store, its read-back probe
  restores nothing, and nothing is committed, with every block reference given back.
- qwen3-next-shaped (gated delta-net layers, two recurrent arrays, and attention): the
  host restores hybrid prefixes on its dense route (flyto-mlx at its enlarged 2,048-token
  block, fusion-mlx at the configured block), and recovery fixes the report: after a
  sparse turn, the next turn restores what the dense route would have cached and
  generates the same tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.demo.arms import ServeConfig
from mlx_recovery_plugin.demo.omlx import OmlxArm
from mlx_recovery_plugin.hosts.omlx.members import Member
from mlx_recovery_plugin.testing.contract import contract_tokens
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import LFM2_SPEC  # the runner's parity tests' hybrid

# flyto-mlx enlarges the block of a model with recurrent layers to 2,048 tokens;
# fusion-mlx keeps the configured one.
HOST_BLOCK = {"omlx": 2048, "fusion_mlx": 64}

# Layer 0 gated delta-net (ArraysCache of conv and SSM state), layer 1 attention; dense MLPs.
QWEN3_NEXT_SPEC = TinyModelSpec(
    arch="qwen3_next", num_layers=2, seed=4,
    extra=(
        ("linear_num_value_heads", 2), ("linear_num_key_heads", 2), ("linear_key_head_dim", 16),
        ("linear_value_head_dim", 16), ("linear_conv_kernel_dim", 4), ("num_experts", 2),
        ("num_experts_per_tok", 1), ("decoder_sparse_step", 1), ("shared_expert_intermediate_size", 32),
        ("mlp_only_layers", [0, 1]), ("moe_intermediate_size", 32), ("partial_rotary_factor", 0.25),
        ("head_dim", 16), ("full_attention_interval", 2),
    ),
)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), TinyModelSpec(arch="llama", num_layers=1, seed=7))
    return load_tiny_model(path)[0]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, draft: Any) -> tuple[Any, Any, Any]:
    model, tokenizer = load_tiny_model(write_tiny_model(tmp_path_factory.mktemp("tiny-lfm2"), LFM2_SPEC))
    return model, tokenizer, draft


def serve_session(
    models: tuple[Any, Any, Any], prompts: list[list[int]], member: Member, root: Path
) -> tuple[dict[str, OmlxArm], Any]:
    """The three arms over ``prompts`` (30 s of think time after each turn); the recovery
    arm's engine counters. Every arm is closed, which raises on a leaked reference."""
    model, tokenizer, draft = models
    config = ServeConfig(
        model_id="tiny-hybrid", block_size=64, prefill_step=128, sparse_threshold=256,
        max_tokens=4, budget_pct=50.0, pool_blocks=512,
    )
    arms = {arm: OmlxArm(arm, model, tokenizer, draft, config, root / arm, member=member)
            for arm in ("sparse_off", "sparse_on", "sparse_recovery")}
    rec = arms["sparse_recovery"]
    try:
        for turn, prompt in enumerate(prompts):
            for arm in arms.values():
                arm.serve(prompt, turn)
                arm.think(30.0)
        assert rec.plugin is not None and rec.instrumentor is not None
        port = rec.instrumentor.engine(rec.scheduler)
        assert port is not None and port.block_size == HOST_BLOCK[member.name]
        counters = rec.plugin.service(port.engine_id).snapshot().counters  # type: ignore[union-attr]
    finally:
        for arm in arms.values():
            arm.close()
    return arms, counters


def test_an_lfm2_prefix_is_never_restored_and_recovery_commits_nothing_it_cannot_restore(
    hybrid: tuple[Any, Any, Any], tmp_path: Path, omlx_member: Member
) -> None:
    tokens = contract_tokens(2500, seed=3)
    # A whole host block (2,048 on flyto-mlx) and more, sparse both times.
    arms, counters = serve_session(hybrid, [tokens[:2200], tokens], omlx_member, tmp_path)
    off, on, rec = (arms[a] for a in ("sparse_off", "sparse_on", "sparse_recovery"))
    # The upstream report, reproduced: the sparse route caches nothing on any turn...
    assert [(t.route, t.cached_tokens) for t in on.result.turns] == [("sparse", 0), ("sparse", 0)]
    # ...and neither does the dense route: the host restores no lfm2 prefix at all.
    assert [(t.route, t.cached_tokens) for t in off.result.turns] == [("dense", 0), ("dense", 0)]
    # Recovery ran and published through the host's store, but the read-back restored
    # nothing, so nothing was committed and the later turn restores nothing either.
    assert [t.cached_tokens for t in rec.result.turns] == [0, 0]
    assert counters.tokens_run >= HOST_BLOCK[omlx_member.name]
    assert counters.faults.get("probe_mismatch", 0) >= 1
    assert counters.blocks_published == 0 and rec.result.recovered_tokens == 0


def test_a_gated_delta_net_hybrid_restores_after_a_sparse_turn_what_the_dense_route_caches(
    draft: Any, tmp_path: Path, omlx_member: Member
) -> None:
    model, tokenizer = load_tiny_model(write_tiny_model(tmp_path / "qwen3-next", QWEN3_NEXT_SPEC))
    tokens = contract_tokens(2300, seed=3)
    # 2,200: sparse. 2,300: dense over the recovered prefix (under 256 tokens left).
    arms, counters = serve_session((model, tokenizer, draft), [tokens[:2200], tokens], omlx_member, tmp_path)
    off, on, rec = (arms[a] for a in ("sparse_off", "sparse_on", "sparse_recovery"))
    assert [(t.route, t.cached_tokens) for t in on.result.turns] == [("sparse", 0), ("sparse", 0)]
    cached_by_dense = off.result.turns[1].cached_tokens
    assert cached_by_dense >= HOST_BLOCK[omlx_member.name]  # the host restores this hybrid
    assert [t.route for t in rec.result.turns] == ["sparse", "dense"]
    assert rec.result.turns[1].cached_tokens == cached_by_dense
    assert rec.outputs[1] == off.outputs[1]
    assert counters.faults == {} and rec.result.recovered_tokens >= cached_by_dense


def test_the_host_stores_a_placeholder_for_the_one_array_conv_state(
    hybrid: tuple[Any, Any, Any], tmp_path: Path, omlx_member: Member
) -> None:
    """The mechanism: a whole block stored through the port is in the host's cache by
    hash, but fetching it restores nothing."""
    from mlx_recovery_plugin.demo.omlx import make_scheduler
    from mlx_recovery_plugin.hosts.omlx.ports import OmlxEngine
    from mlx_recovery_plugin.kvcodec import blocks_from_cache

    model, tokenizer, _ = hybrid
    config = ServeConfig(model_id="tiny-hybrid", block_size=64, prefill_step=128, sparse_threshold=256, pool_blocks=512)
    scheduler = make_scheduler(model, tokenizer, tmp_path / "cache", config, member=omlx_member)
    try:
        engine = OmlxEngine(scheduler, "hybrid", member=omlx_member)
        block = engine.block_size
        tokens = contract_tokens(block, seed=5)
        cache = make_prompt_cache(model)
        for start in range(0, block, 128):
            model(mx.array(tokens[start : start + 128])[None], cache=cache)
        blocks = blocks_from_cache(cache, 0, 1, block, origin="recovery")
        assert engine.prefix_cache.store("job", tokens, blocks) == block
        assert engine.prefix_cache.stored_tokens(tokens) == block  # found by hash...
        assert engine.prefix_cache.fetch("probe", tokens).tokens == 0  # ...never restored
        engine.prefix_cache.release("probe")
        assert engine.prefix_cache.holders() == []
    finally:
        scheduler.shutdown()
