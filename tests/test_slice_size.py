"""Slice sizing from the publish policy's cost model: one model for both, so a slice
deep in a long context, where attention costs more per token, is cut shorter."""

from __future__ import annotations

from mlx_recovery_plugin.recovery.slice_size import ARRIVAL_WAIT_S, MIN_STOP_GRAIN, SliceSizer
from mlx_recovery_plugin.runner.runner import STOP_GRAIN

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


def test_an_allowance_that_pays_exactly_three_blocks_gets_three_despite_float_rounding() -> None:
    sizer = SliceSizer(2048, B, remaining_s=lambda: 0.7)
    sizer.learn(3 * B, 0.7)  # 3 blocks per 0.7 s; 0.7 s left: 191.99999999999997 tokens in floats
    assert sizer.tokens_now(0) == 3 * B


def test_a_slice_that_would_leave_one_block_of_the_job_runs_to_the_jobs_end() -> None:
    sizer = SliceSizer(2048, B, remaining_s=lambda: 4 * B / 1000 + 1e-9)
    assert sizer.end(0, 2 * B) == B  # nothing measured yet: one block, even one short
    sizer.learn(B, B / 1000)  # 1,000 tokens per second: the allowance pays for 4 blocks
    assert sizer.end(0, 5 * B) == 5 * B  # 4 would leave one: all 5
    assert sizer.end(B, 5 * B + 10) == 5 * B + 10  # a tail of one block or less too
    assert sizer.end(0, 6 * B) == 4 * B  # two left: the next window's
    assert sizer.end(0, 4 * B) == 4 * B
    capped = SliceSizer(4 * B, B, remaining_s=lambda: 1e6)
    capped.learn(B, B / 1000)
    assert capped.end(0, 5 * B) == 4 * B  # never past the configured slice


def wide_two_layers(tokens: int, context: int) -> float:
    """A dense pass of a 3072-wide, 2-layer target as the real server's slices fitted it."""
    return tokens * (1.40e-3 + 5.9e-7 * (context + tokens / 2))


def test_passes_are_cut_finer_where_one_layer_would_keep_an_arriving_request_waiting() -> None:
    sizer = SliceSizer(2048, 256, remaining_s=lambda: 10.0, predict=wide_two_layers)
    # Near the start a layer of a 256-token pass takes 0.21 s: the runner's own passes.
    assert STOP_GRAIN == 256 and sizer.stop_grain(512, layers=2) is None
    # At 9k context it would take 0.88 s; passes of 64 tokens take 0.22 s a layer.
    deep = sizer.stop_grain(9472, layers=2)
    assert deep == 64
    assert wide_two_layers(deep, 9472 - deep) / 2 <= ARRIVAL_WAIT_S < wide_two_layers(2 * deep, 9472 - 2 * deep) / 2
    # The same cost spread over 32 layers keeps a layer short.
    assert sizer.stop_grain(9472, layers=32) is None
    # Never finer than MIN_STOP_GRAIN, however slow.
    assert sizer.stop_grain(1_000_000, layers=1) == MIN_STOP_GRAIN


def test_the_grain_goes_by_the_layer_cost_where_the_slices_own_cost_is_not_known() -> None:
    no_cost = lambda tokens, context: None  # noqa: E731 - the current regime's model, unfitted
    sizer = SliceSizer(2048, 256, remaining_s=lambda: 10.0, predict=no_cost, layer_predict=wide_two_layers)
    assert sizer.stop_grain(9472, 2) == SliceSizer(2048, 256, remaining_s=lambda: 10.0,
                                                   predict=wide_two_layers).stop_grain(9472, 2)
    assert sizer.stop_grain(9472, 2) is not None
    assert sizer.tokens_now(0) == 256, "the slice's size still waits for its own cost"


def test_without_a_cost_the_runner_keeps_its_own_passes() -> None:
    assert SliceSizer(2048, 256, remaining_s=lambda: 1.0, predict=lambda t, c: None).stop_grain(9472, 2) is None
    assert SliceSizer(2048, 256, remaining_s=lambda: 1.0).stop_grain(9472, 2) is None
    assert SliceSizer(2048, 256, remaining_s=lambda: 1.0, predict=wide_two_layers).stop_grain(9472, 0) is None
