"""The cost-balance measurement every report prints: real passes on a real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_recovery_plugin.bench.balance import LLAMA3_8B, RealShape, measure_balance, reference_ratio
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model, write_tiny_model
from test_runner import LFM2_SPEC


def test_the_balance_times_a_token_at_long_context_against_one_at_zero(tiny_llama_dir: Path) -> None:
    # Which one is slower is a measurement (a benchmark's business, and a loaded machine
    # can flip one pair); what the report says of the two timings is checked here.
    model, _ = load_tiny_model(tiny_llama_dir)
    balance = measure_balance(model, 4096, chunk=64, repeats=1)
    assert balance.long_s > 0 and balance.short_s > 0
    assert balance.ratio == pytest.approx(balance.long_s / balance.short_s)
    assert "4,096 context" in balance.describe()
    assert balance.as_dict()["reference_model"] == LLAMA3_8B.name


def test_the_measurement_leaves_no_context_behind(tiny_llama_dir: Path) -> None:
    """Each timed pass is trimmed back, so every repeat attends over the same context."""
    from mlx_recovery_plugin.bench import balance as module

    model, _ = load_tiny_model(tiny_llama_dir)
    cache = module._filled_cache(model, 300)
    import mlx.core as mx

    module._timed_pass(model, mx.array([[1, 2, 3]]), cache)
    module._timed_pass(model, mx.array([[1, 2, 3]]), cache)
    assert all(layer.offset == 300 for layer in cache)


def test_reference_ratio_grows_with_context_and_is_matmul_bound_for_a_real_shape() -> None:
    assert reference_ratio(0) == 1.0
    assert 1.1 < reference_ratio(10_000) < 2.0  # an 8B model at 10k: mostly matrix products
    narrow = RealShape("narrow", 64, 2, 4, 2, 128)
    assert reference_ratio(10_000, narrow) > 10 * reference_ratio(10_000)


def test_a_model_with_non_kv_cache_layers_is_refused(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "lfm2", LFM2_SPEC)
    model, _ = load_tiny_model(path)
    with pytest.raises(ValueError, match="plain KVCache"):
        measure_balance(model, 128, chunk=16, repeats=1)
