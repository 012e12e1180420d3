"""Timing attention at a depth on the model's own shapes: which models can be timed so,
and the arithmetic that turns one kernel's time into seconds per token of a pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_recovery_plugin.runner.attention_probe import (
    PROBE_QUERIES,
    attention_seconds_per_token,
    attention_shape,
    probe_for,
)
from mlx_recovery_plugin.testing.mlx_lm_models import HYBRID, SLIDING
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model


def test_a_full_attention_model_gives_its_heads_head_size_layers_and_dtype(loaded) -> None:
    model, _, _ = loaded
    shape = attention_shape(model)
    attn = model.layers[0].self_attn
    assert shape is not None
    assert (shape.layers, shape.heads, shape.kv_heads) == (len(model.layers), attn.n_heads, attn.n_kv_heads)
    assert shape.heads * shape.head_dim == attn.q_proj.weight.shape[0]
    assert shape.dtype == mx.float32


@pytest.mark.parametrize("spec", [SLIDING, HYBRID], ids=["sliding-window", "hybrid"])
def test_a_model_whose_layers_are_not_all_full_attention_is_not_timed(spec: TinyModelSpec, tmp_path: Path) -> None:
    model, _ = load_tiny_model(write_tiny_model(tmp_path / spec.arch, spec))
    assert attention_shape(model) is None
    handle: Any = type("Handle", (), {"model": model, "stream": None})()
    assert probe_for(handle)(4096) is None


def test_seconds_per_token_are_the_fastest_timing_times_layers_over_queries(loaded) -> None:
    model, _, _ = loaded
    shape = attention_shape(model)
    assert shape is not None
    ticks = iter([0.0, 0.5, 10.0, 10.2, 20.0, 20.3])  # timings of 0.5, 0.2 and 0.3 s
    seconds = attention_seconds_per_token(shape, 2048, repeats=3, clock=lambda: next(ticks))
    assert seconds == pytest.approx(0.2 * shape.layers / PROBE_QUERIES)
    assert attention_seconds_per_token(shape, 0) == 0.0


def test_the_probe_times_the_real_kernel_on_the_models_stream(loaded) -> None:
    model, _, _ = loaded
    handle: Any = type("Handle", (), {"model": model, "stream": mx.default_stream(mx.cpu)})()
    seconds = probe_for(handle)(1024)
    assert seconds is not None and 0.0 < seconds < 1.0
