"""Tiny models for the mlx-lm server adapter: one per kind of prompt cache.

* ``HYBRID``: qwen3_next-shaped; layer 0 a gated delta-net (``ArraysCache``, never
  trimmable), layer 1 attention (``KVCache``).
* ``SLIDING``: gemma3-shaped; layer 0 a sliding-window layer (``RotatingKVCache`` of
  ``SLIDING_WINDOW`` tokens, not trimmable once past it), layer 1 global attention.
* ``REFERENCE``: qwen3, every layer a ``KVCache`` (mlx-lm trims a copy itself).

Random float32 weights, the byte-level tokenizer of :mod:`.tiny_model`.
"""

from __future__ import annotations

from .tiny_model import TinyModelSpec

SLIDING_WINDOW = 48

HYBRID = TinyModelSpec(
    arch="qwen3_next", num_layers=2, seed=4,
    extra=(
        ("linear_num_value_heads", 2), ("linear_num_key_heads", 2), ("linear_key_head_dim", 16),
        ("linear_value_head_dim", 16), ("linear_conv_kernel_dim", 4), ("num_experts", 2),
        ("num_experts_per_tok", 1), ("decoder_sparse_step", 1), ("shared_expert_intermediate_size", 32),
        ("mlp_only_layers", [0, 1]), ("moe_intermediate_size", 32), ("partial_rotary_factor", 0.25),
        ("head_dim", 16), ("full_attention_interval", 2),
    ),
)

SLIDING = TinyModelSpec(
    arch="gemma3_text", num_layers=2, num_heads=4, num_kv_heads=1, seed=5,
    extra=(
        ("head_dim", 16), ("query_pre_attn_scalar", 16), ("sliding_window", SLIDING_WINDOW),
        ("sliding_window_pattern", 2), ("rope_local_base_freq", 10000.0),
    ),
)

REFERENCE = TinyModelSpec(arch="qwen3", num_layers=2, seed=6)

#: kind -> spec, in the order reports list them.
SPECS = {"hybrid": HYBRID, "sliding": SLIDING, "reference": REFERENCE}
