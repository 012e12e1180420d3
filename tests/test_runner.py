"""The recovery runner against plain mlx-lm, on tiny real float32 models.

Bars (issue 4): (a) a cache rebuilt from the published blocks equals the runner's own live
state exactly; (b) against a cold dense mlx-lm run of the same prompt, the greedy
continuation is identical and the next-token logits differ by at most 1e-4.
Architectures: llama, qwen3 and lfm2 (a hybrid: short-convolution layers with
``ArraysCache`` state between attention layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from mlx_recovery_plugin.kvcodec import UnsupportedCacheError, cache_arrays, cache_from_blocks
from mlx_recovery_plugin.ports import FetchedPrefix, ModelHandle
from mlx_recovery_plugin.runner import LiveState, SliceRunner
from mlx_recovery_plugin.state import BlockState
from mlx_recovery_plugin.testing import BlockPool, LoadedModel, PagedPrefixCache
from mlx_recovery_plugin.testing.caches import caches_equal, logical_state
from mlx_recovery_plugin.testing.recorder import byte_tokens
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model

BLOCK = 64
PROMPT = 1100  # several 512-token slices plus a partial block
CONTINUE = 8

LFM2_SPEC = TinyModelSpec(
    arch="lfm2",
    num_layers=3,
    seed=2,
    extra=(
        ("norm_eps", 1e-5),
        ("conv_bias", False),
        ("conv_L_cache", 3),
        ("block_dim", 64),
        ("block_ff_dim", 128),
        ("block_multiple_of", 16),
        ("block_ffn_dim_multiplier", 1.0),
        ("block_auto_adjust_ff_dim", False),
        ("layer_types", ["conv", "full_attention", "conv"]),
        ("tie_word_embeddings", True),
    ),
)


@pytest.fixture(scope="module")
def models(
    tiny_llama_dir: Path, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, LoadedModel]:
    lfm2_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-lfm2"), LFM2_SPEC)
    out = {}
    for name, path in (("llama", tiny_llama_dir), ("qwen3", tiny_qwen3_dir), ("lfm2", lfm2_dir)):
        model, _ = load_tiny_model(path)
        out[name] = LoadedModel(f"tiny-{name}", model)
    return out


class WindowedModel:
    """A handle whose caches are sliding windows (as ``mlx_lm`` makes with ``max_kv_size``)."""

    def __init__(self, inner: LoadedModel, max_size: int, keep: int) -> None:
        self.model_id = inner.model_id + "-window"
        self.model = inner.model
        self.stream = None
        self._layers = len(inner.model.layers)
        self._max_size, self._keep = max_size, keep

    def make_cache(self) -> list[Any]:
        return [RotatingKVCache(self._max_size, self._keep) for _ in range(self._layers)]


def run_all(
    runner: SliceRunner, live: LiveState, end: int, slice_tokens: int
) -> list[BlockState]:
    blocks: list[BlockState] = []
    while live.offset < end:
        out = runner.advance(live, min(end, live.offset + slice_tokens), lambda: False)
        assert not out.interrupted
        blocks += out.blocks
    return blocks


def cold_cache(handle: ModelHandle, prompt: Sequence[int], chunk: int) -> list[Any]:
    """Plain mlx-lm prefill, the way its generate loop does it."""
    cache = handle.make_cache()
    for start in range(0, len(prompt), chunk):
        handle.model(mx.array(prompt[start : start + chunk])[None], cache=cache)
        mx.eval(cache_arrays(cache))
    return cache


def continue_greedy(
    handle: ModelHandle, cache: list[Any], rest: Sequence[int], steps: int = CONTINUE
) -> tuple[mx.array, list[int]]:
    """Feed ``rest`` (the prompt after the cache), return the next-token logits and
    ``steps`` greedy tokens."""
    logits = handle.model(mx.array(rest)[None], cache=cache)[:, -1]
    first = logits
    out = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        out.append(int(token.item()))
        logits = handle.model(token[None], cache=cache)[:, -1]
    return first, out


def frozen(cache: list[Any]) -> list[tuple[Any, ...]]:
    """A deep copy of a cache's logical state, immune to later in-place writes."""
    out = []
    for layer in logical_state(cache):
        out.append(tuple(mx.array(x) if isinstance(x, mx.array) else x for x in layer))
    mx.eval([x for layer in out for x in layer if isinstance(x, mx.array)])
    return out


def same_state(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != len(y):
            return False
        for p, q in zip(x, y):
            if isinstance(p, mx.array):
                if not isinstance(q, mx.array) or p.shape != q.shape:
                    return False
                if not mx.array_equal(p, q).item():
                    return False
            elif p != q:
                return False
    return True


def stop_after(n: int) -> Callable[[], bool]:
    """A stop signal that turns True on its ``n``-th check (0: the first)."""
    seen = [0]

    def should_stop() -> bool:
        seen[0] += 1
        return seen[0] > n

    return should_stop


# -- parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("slice_tokens", [64, 128, 256, 512])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "lfm2"])
def test_blocks_restore_the_live_state_and_continue_like_a_cold_dense_run(
    models: dict[str, LoadedModel], arch: str, slice_tokens: int
) -> None:
    handle = models[arch]
    prompt = byte_tokens(PROMPT, seed=3)
    whole = PROMPT // BLOCK
    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(prompt)
    blocks = run_all(runner, live, whole * BLOCK, slice_tokens)
    assert [b.index for b in blocks] == list(range(whole))
    # (a) exact: the cache rebuilt from the blocks equals the runner's live state.
    rebuilt = cache_from_blocks(handle.make_cache, blocks)
    assert caches_equal(rebuilt, live.cache)
    # (b) against plain mlx-lm prefill of the whole prompt but its last token.
    cold = cold_cache(handle, prompt[:-1], slice_tokens)
    cold_logits, cold_tokens = continue_greedy(handle, cold, prompt[-1:])
    logits, greedy = continue_greedy(handle, rebuilt, prompt[whole * BLOCK :])
    assert greedy == cold_tokens
    assert mx.abs(logits - cold_logits).max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_blocks_stored_and_fetched_through_the_mock_host_restore_the_live_state(
    models: dict[str, LoadedModel], arch: str
) -> None:
    handle = models[arch]
    prompt = byte_tokens(700, seed=5)
    pool = BlockPool(num_blocks=32, block_size=BLOCK)
    prefix_cache = PagedPrefixCache(pool, handle.model_id)
    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(prompt)
    while live.offset < 640:
        out = runner.advance(live, min(640, live.offset + 200), lambda: False)
        boundary = (live.offset // BLOCK) * BLOCK
        if out.blocks:
            stored = prefix_cache.store("job", prompt[:boundary], out.blocks)
            assert stored == boundary

    fetched = prefix_cache.fetch("probe", prompt)
    try:
        assert fetched.tokens == 640
        resumed = runner.begin(prompt, fetched)
        assert resumed.offset == 640
        assert caches_equal(resumed.cache, live.cache)
        # Both go on to the same blocks from there.
        assert_blocks_equal(
            run_all(runner, resumed, 700, 128), run_all(runner, live, 700, 128)
        )
    finally:
        prefix_cache.release("probe")
    assert prefix_cache.holders == []
    assert all(pool.refcount(block_id) <= 1 for block_id in range(pool.num_blocks))


def assert_blocks_equal(a: list[BlockState], b: list[BlockState]) -> None:
    assert [x.index for x in a] == [y.index for y in b]
    for x, y in zip(a, b):
        for p, q in zip(x.arrays(), y.arrays()):
            assert p.shape == q.shape and mx.array_equal(p, q).item()


def test_a_prefix_restored_from_blocks_resumes_exactly_where_the_blocks_end(
    models: dict[str, LoadedModel],
) -> None:
    handle = models["qwen3"]
    prompt = byte_tokens(600, seed=9)
    runner = SliceRunner(handle, BLOCK)
    straight = runner.begin(prompt)
    all_blocks = run_all(runner, straight, 600, 256)

    resumed = runner.begin(prompt, FetchedPrefix(tokens=256, blocks=tuple(all_blocks[:4])))
    later = run_all(runner, resumed, 600, 256)
    assert_blocks_equal(later, all_blocks[4:])


# -- block records ---------------------------------------------------------------------


def test_published_blocks_say_recovery_and_carry_no_draft_state(
    models: dict[str, LoadedModel],
) -> None:
    handle = models["lfm2"]
    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(byte_tokens(300))
    out = runner.advance(live, 300)
    assert out.tokens_run == 300 and not out.interrupted
    assert [b.index for b in out.blocks] == [0, 1, 2, 3]
    assert all(b.origin == "recovery" and not b.draft_state for b in out.blocks)
    assert all(b.nbytes > 0 for b in out.blocks)
    # Recurrent layers publish a snapshot, attention layers this block's 64 positions.
    kinds = [type(layer).__name__ for layer in out.blocks[0].layers]
    assert kinds == ["RecurrentSnapshot", "KVBlock", "RecurrentSnapshot"]
    assert out.blocks[0].layers[1].keys.shape[2] == BLOCK


def test_a_slice_that_completes_no_block_publishes_nothing_but_advances(
    models: dict[str, LoadedModel],
) -> None:
    runner = SliceRunner(models["llama"], BLOCK)
    live = runner.begin(byte_tokens(200))
    out = runner.advance(live, 40)
    assert out.blocks == [] and out.tokens_run == 40 and live.offset == 40
    out = runner.advance(live, 130)
    assert [b.index for b in out.blocks] == [0, 1] and live.offset == 130


# -- interruption ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_an_interrupted_slice_keeps_its_finished_passes_and_undoes_only_the_stopped_one(
    models: dict[str, LoadedModel], arch: str
) -> None:
    handle = models[arch]
    prompt = byte_tokens(900, seed=4)
    runner = SliceRunner(handle, BLOCK)
    reference = runner.begin(prompt)
    expected = run_all(runner, reference, 900, 300)

    # How many stop checks a 300..600 slice makes (passes end at every 256-token mark, and
    # the hybrid's also at block boundaries; every pass checks before each layer).
    probe = runner.begin(prompt)
    runner.advance(probe, 300)
    checks = runner.advance(probe, 600, lambda: False).stop_checks
    runner.discard(probe)
    assert checks >= 2 * len(handle.model.layers)
    kept_offsets = set()
    for n in range(checks):
        live = runner.begin(prompt)
        first = runner.advance(live, 300)
        before = frozen(live.cache)
        out = runner.advance(live, 600, stop_after(n))
        assert out.interrupted and out.interruptible
        assert 300 <= live.offset < 600 and out.tokens_run == live.offset - 300
        if live.offset == 300:  # stopped in the first pass: exactly as before the slice
            assert out.blocks == [] and same_state(frozen(live.cache), before)
        kept_offsets.add(live.offset)
        # The job carries on from the kept passes to the very blocks of an uninterrupted run.
        rest = runner.advance(live, 600, lambda: False).blocks + run_all(runner, live, 900, 300)
        assert_blocks_equal(first.blocks + out.blocks + rest, expected)
        runner.discard(live)
    assert 300 in kept_offsets and 512 in kept_offsets


def test_a_slice_stops_within_one_layer_of_the_signal(models: dict[str, LoadedModel]) -> None:
    handle = models["llama"]
    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(byte_tokens(512))
    out = runner.advance(live, 512, stop_after(1))
    # Checked before each layer: the check before the second layer saw the signal and
    # the slice stopped there.
    assert out.interrupted and out.stop_checks == 2


def test_long_slices_run_in_small_passes_so_a_stop_waits_for_one_small_layer(
    models: dict[str, LoadedModel],
) -> None:
    handle = models["llama"]
    layers = len(handle.model.layers)
    prompt = byte_tokens(512)
    fine, coarse = SliceRunner(handle, BLOCK, stop_grain=128), SliceRunner(handle, BLOCK, stop_grain=4096)
    fine_live, coarse_live = fine.begin(prompt), coarse.begin(prompt)
    assert fine.advance(fine_live, 512, lambda: False).stop_checks == 4 * layers
    assert coarse.advance(coarse_live, 512, lambda: False).stop_checks == layers
    # A slice may ask for finer passes than the runner's own (deep in a long context),
    # never coarser ones.
    assert coarse.advance(coarse.begin(prompt), 512, lambda: False, stop_grain=128).stop_checks == 4 * layers
    assert fine.advance(fine.begin(prompt), 512, lambda: False, stop_grain=4096).stop_checks == 4 * layers
    # Same blocks within float32 noise, whatever the passes.
    rebuilt_fine = cache_from_blocks(handle.make_cache, fine.advance(fine.begin(prompt), 512).blocks)
    rebuilt_coarse = cache_from_blocks(handle.make_cache, coarse.advance(coarse.begin(prompt), 512).blocks)
    for a, b in zip(rebuilt_fine, rebuilt_coarse):
        assert mx.abs(a.keys[..., :512, :] - b.keys[..., :512, :]).max().item() <= 1e-4


def test_a_non_interruptible_runner_ignores_the_stop_signal(
    models: dict[str, LoadedModel],
) -> None:
    runner = SliceRunner(models["qwen3"], BLOCK, interruptible=False)
    live = runner.begin(byte_tokens(300))
    out = runner.advance(live, 300, lambda: True)
    assert not out.interrupted and not out.interruptible
    assert out.tokens_run == 300 and live.offset == 300


def test_a_stop_signal_already_set_abandons_before_any_layer_runs(
    models: dict[str, LoadedModel],
) -> None:
    runner = SliceRunner(models["llama"], BLOCK)
    live = runner.begin(byte_tokens(300))
    out = runner.advance(live, 300, lambda: True)
    assert out.interrupted and out.stop_checks == 1 and live.offset == 0


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_an_error_mid_slice_is_raised_with_the_cache_restored_and_unhooked(
    models: dict[str, LoadedModel], arch: str
) -> None:
    runner = SliceRunner(models[arch], BLOCK)
    live = runner.begin(byte_tokens(400))
    runner.advance(live, 100)
    before = frozen(live.cache)
    calls = [0]

    def failing() -> bool:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("simulated out of memory")
        return False

    with pytest.raises(MemoryError):
        runner.advance(live, 400, failing)
    assert live.offset == 100
    assert same_state(frozen(live.cache), before)
    for layer in live.cache:
        assert "update_and_fetch" not in vars(layer)
        if isinstance(layer, ArraysCache):
            assert type(layer.cache) is list
    # And it still works afterwards.
    assert runner.advance(live, 400).tokens_run == 300


# -- sliding windows -------------------------------------------------------------------


@pytest.mark.parametrize(("max_size", "keep"), [(48, 0), (48, 4), (200, 4)])
def test_sliding_window_blocks_restore_the_window_and_continue_like_plain_mlx_lm(
    models: dict[str, LoadedModel], max_size: int, keep: int
) -> None:
    handle = WindowedModel(models["llama"], max_size, keep)
    prompt = byte_tokens(700, seed=6)
    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(prompt)
    blocks = run_all(runner, live, 640, 100)  # slices end mid-block: carried heads
    assert [b.index for b in blocks] == list(range(10))

    rebuilt = cache_from_blocks(handle.make_cache, blocks)
    assert caches_equal(rebuilt, live.cache)
    # mlx-lm's window with sink positions (keep > 0) masks by buffer slot, so its result
    # depends on the chunk schedule: compare with plain mlx-lm on the same schedule.
    cold = cold_cache(handle, prompt[:640], 100)
    cold_logits, cold_tokens = continue_greedy(handle, cold, prompt[640:])
    logits, greedy = continue_greedy(handle, rebuilt, prompt[640:])
    assert greedy == cold_tokens
    assert mx.abs(logits - cold_logits).max().item() <= 1e-4


def test_one_token_slices_on_a_sliding_window_interrupt_cleanly(
    models: dict[str, LoadedModel],
) -> None:
    handle = WindowedModel(models["llama"], 32, 2)
    prompt = byte_tokens(200, seed=8)
    runner = SliceRunner(handle, BLOCK)
    live = runner.begin(prompt)
    run_all(runner, live, 100, 50)
    runner.advance(live, 101)  # the window now has its final size
    before = frozen(live.cache)
    out = runner.advance(live, 102, stop_after(1))  # one token: mlx-lm writes in place
    assert out.interrupted and live.offset == 101
    assert same_state(frozen(live.cache), before)
    tail = run_all(runner, live, 192, 1)
    straight = runner.begin(prompt)
    run_all(runner, straight, 100, 50)
    assert_blocks_equal(run_all(runner, straight, 192, 1), tail)


# -- lifecycle and misuse ---------------------------------------------------------------


def test_runs_on_the_model_stream_when_the_host_gives_one(models: dict[str, LoadedModel]) -> None:
    inner = models["llama"]
    handle = LoadedModel(inner.model_id, inner.model, stream=mx.new_stream(mx.cpu))
    runner = SliceRunner(handle, BLOCK)
    on_stream = runner.advance(runner.begin(byte_tokens(200)), 200).blocks
    plain = SliceRunner(inner, BLOCK)
    assert_blocks_equal(on_stream, plain.advance(plain.begin(byte_tokens(200)), 200).blocks)


def test_discard_is_idempotent_and_a_discarded_job_cannot_advance(
    models: dict[str, LoadedModel],
) -> None:
    runner = SliceRunner(models["llama"], BLOCK)
    live = runner.begin(byte_tokens(100))
    runner.advance(live, 64)
    runner.discard(live)
    runner.discard(live)
    assert live.discarded and live.cache == []
    with pytest.raises(ValueError):
        runner.advance(live, 100)


def test_slice_bounds_and_prefix_shape_are_checked(models: dict[str, LoadedModel]) -> None:
    runner = SliceRunner(models["llama"], BLOCK)
    live = runner.begin(byte_tokens(100))
    empty = runner.advance(live, 0)
    assert (empty.blocks, empty.tokens_run, empty.interrupted) == ([], 0, False)
    with pytest.raises(ValueError):
        runner.advance(live, 101)
    runner.advance(live, 50)
    with pytest.raises(ValueError):
        runner.advance(live, 49)
    with pytest.raises(ValueError):
        runner.begin(byte_tokens(100), FetchedPrefix(tokens=32, blocks=()))
    with pytest.raises(ValueError):
        SliceRunner(models["llama"], 0)


def test_a_model_with_unsupported_caches_is_refused_at_begin(
    models: dict[str, LoadedModel],
) -> None:
    from mlx_lm.models.cache import QuantizedKVCache

    class Quantized(WindowedModel):
        def make_cache(self) -> list[Any]:
            return [QuantizedKVCache() for _ in range(self._layers)]

    runner = SliceRunner(Quantized(models["llama"], 64, 0), BLOCK)
    with pytest.raises(UnsupportedCacheError):
        runner.begin(byte_tokens(100))


def test_the_clock_is_injected(models: dict[str, LoadedModel]) -> None:
    ticks = iter([10.0, 12.5])
    runner = SliceRunner(models["llama"], BLOCK, clock=lambda: next(ticks))
    out = runner.advance(runner.begin(byte_tokens(80)), 80)
    assert out.seconds == 2.5
