"""Slice sizing from the publish policy's cost model: one model for both, so a slice
deep in a long context, where attention costs more per token, is cut shorter."""

from __future__ import annotations

from mlx_recovery_plugin.recovery.slice_size import SliceSizer

B = 64


def attention_bound(tokens: int, context: int) -> float:
    return tokens * (1e-3 + 1e-6 * (context + tokens / 2))


def test_a_slice_deep_in_the_context_is_cut_shorter_than_one_near_its_start() -> None:
    sizer = SliceSizer(2048, B, remaining_s=lambda: 1.0, predict=attention_bound)
    assert sizer.tokens_now(0) == B  # nothing measured yet: one block
    sizer.learn(B, attention_bound(B, 0) * 1.1, context=0)  # 10 % overhead on the model
    shallow, deep = sizer.tokens_now(0), sizer.tokens_now(8192)
    assert shallow % B == 0 and deep % B == 0
    assert deep < shallow
    assert attention_bound(deep, 8192) * 1.1 <= 1.0 < attention_bound(deep + B, 8192) * 1.1


def test_never_below_one_block_nor_above_the_configured_slice() -> None:
    sizer = SliceSizer(512, B, remaining_s=lambda: 1e-6, predict=attention_bound)
    sizer.learn(B, 1.0, context=0)
    assert sizer.tokens_now(100_000) == B
    roomy = SliceSizer(512, B, remaining_s=lambda: 1e6, predict=attention_bound)
    roomy.learn(B, 1.0, context=0)
    assert roomy.tokens_now(0) == 512


def test_without_a_fitted_model_the_measured_rate_sizes_the_slice() -> None:
    sizer = SliceSizer(2048, B, remaining_s=lambda: 2.0, predict=lambda tokens, context: None)
    sizer.learn(256, 1.0)  # 256 tokens per charged second
    assert sizer.tokens_now(0) == 512
