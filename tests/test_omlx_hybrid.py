"""A hybrid model (lfm2-shaped: short-convolution layers with one recurrent array, and an
attention layer) on the real scheduler of each oMLX family member: what recovery
publishes, and what a later turn restores.

What really happens (flyto-mlx 0.7.0, fusion-mlx 0.10.24): the host's prefix cache keeps a
recurrent layer's state only when it has two arrays (conv and SSM, the GDN / Mamba shape);
lfm2's one-array conv state is stored as a placeholder, and every restore that ends on a
placeholder is rejected ("partial prefix match detected ... Rejecting cache"). So the host
restores no lfm2 prefix at all, dense route included, and the upstream report (hybrid model
+ SpecPrefill: 0 cached tokens on every turn) is not fixed by recovery here: recovery
publishes through the host's own store, its read-back probe restores nothing, and nothing
is committed, with every block reference given back.
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


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    model, tokenizer = load_tiny_model(write_tiny_model(tmp_path_factory.mktemp("tiny-lfm2"), LFM2_SPEC))
    draft_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), TinyModelSpec(arch="llama", num_layers=1, seed=7))
    draft, _ = load_tiny_model(draft_dir)
    return model, tokenizer, draft


def test_a_hybrid_prefix_is_never_restored_and_recovery_commits_nothing_it_cannot_restore(
    hybrid: tuple[Any, Any, Any], tmp_path: Path, omlx_member: Member
) -> None:
    model, tokenizer, draft = hybrid
    tokens = contract_tokens(2500, seed=3)
    prompts = [tokens[:2200], tokens]  # a whole host block (2,048 on flyto) and more
    config = ServeConfig(
        model_id="tiny-hybrid", block_size=64, prefill_step=128, sparse_threshold=256,
        max_tokens=4, budget_pct=50.0, pool_blocks=512,
    )
    arms = {arm: OmlxArm(arm, model, tokenizer, draft, config, tmp_path / arm, member=omlx_member)
            for arm in ("sparse_off", "sparse_on", "sparse_recovery")}
    rec = arms["sparse_recovery"]
    try:
        for turn, prompt in enumerate(prompts):
            for arm in arms.values():
                arm.serve(prompt, turn)
                arm.think(30.0)
        assert rec.plugin is not None and rec.instrumentor is not None
        port = rec.instrumentor.engine(rec.scheduler)
        assert port is not None and port.block_size == HOST_BLOCK[omlx_member.name]
        counters = rec.plugin.service(port.engine_id).snapshot().counters  # type: ignore[union-attr]
    finally:
        for arm in arms.values():
            arm.close()  # raises if any block reference was left behind

    off, on = arms["sparse_off"], arms["sparse_on"]
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
