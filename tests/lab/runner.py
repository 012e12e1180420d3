"""``python tests/lab runner``: the recovery runner against plain mlx-lm prefill.

Same model, same tokens, one process, arms alternating (plain first on even repeats,
runner first on odd ones) so drift hits both. It prints:

* throughput of each arm and the runner / plain ratio per repeat (median, min, max);
* peak memory above the starting point of each arm (``mx.get_peak_memory``, reset
  between arms), the runner's extra over plain, the bytes of the blocks it published
  and plain's own transient activations (its peak minus what it ends with);
* arrival wait: the time from ``should_stop`` turning True to ``advance()`` returning,
  with interruptible slices and with whole slices, against one full slice's time.

The default model is a random float32 llama (BENCH_TARGET: two layers of hidden 4,096, feed-forward 11,008) written once with
:mod:`mlx_recovery_plugin.testing.tiny_model`. Float32 on Linux is 15-20x faster with the
system OpenBLAS preloaded; by default the bench re-executes itself with it when found.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_recovery_plugin.bench.balance import measure_or_say_why
from mlx_recovery_plugin.bench.openblas import add_openblas_flag, maybe_reexec
from mlx_recovery_plugin.kvcodec import cache_arrays
from mlx_recovery_plugin.ports import FetchedPrefix
from mlx_recovery_plugin.runner import SliceRunner, blas
from mlx_recovery_plugin.state import BlockState

from .stats import describe as describe_samples


@dataclass(slots=True)
class BenchHandle:
    """A ModelHandle over a loaded mlx-lm model."""

    model_id: str
    model: Any
    stream: Any = None

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)


@dataclass(slots=True)
class RunnerBenchResult:
    """Everything one bench run measured (seconds, bytes, tokens per second)."""

    blas: str
    model: str
    tokens: int
    slice_tokens: int
    block_size: int
    plain_tps: list[float] = field(default_factory=list)
    runner_tps: list[float] = field(default_factory=list)
    plain_peak_extra: list[int] = field(default_factory=list)
    runner_peak_extra: list[int] = field(default_factory=list)
    plain_transient: list[int] = field(default_factory=list)
    published_bytes: int = 0
    full_slice_s: float = 0.0
    wait_interruptible_s: list[float] = field(default_factory=list)
    wait_whole_slice_s: list[float] = field(default_factory=list)
    balance: dict[str, Any] | None = None  # bench/balance.py at ``tokens`` of context
    balance_line: str = "cost balance: not measured"

    @property
    def ratios(self) -> list[float]:
        return [r / p for r, p in zip(self.runner_tps, self.plain_tps)]

    def summary(self) -> str:
        mib = 1 << 20
        ratios = self.ratios
        lines = [
            f"model {self.model}, {self.tokens} tokens, {self.slice_tokens}-token slices, "
            f"{self.block_size}-token blocks; BLAS: {self.blas}",
            self.balance_line,
            f"plain mlx-lm : {describe_samples(self.plain_tps, '{:.0f}')} tokens/s",
            f"runner       : {describe_samples(self.runner_tps, '{:.0f}')} tokens/s",
            f"ratio        : {describe_samples(ratios, '{:.3f}')} (runner / plain, {len(ratios)} repeats)",
            f"peak memory above start: plain {_med(self.plain_peak_extra) / mib:.1f} MiB, "
            f"runner {_med(self.runner_peak_extra) / mib:.1f} MiB; extra "
            f"{(_med(self.runner_peak_extra) - _med(self.plain_peak_extra)) / mib:.1f} MiB vs "
            f"published blocks {self.published_bytes / mib:.1f} MiB + one slice's activations "
            f"{_med(self.plain_transient) / mib:.1f} MiB",
        ]
        if self.full_slice_s:
            lines.append(
                f"arrival wait : interruptible {describe_samples(self.wait_interruptible_s, '{:.3f}')} s, "
                f"whole slices {describe_samples(self.wait_whole_slice_s, '{:.3f}')} s "
                f"(one full slice {self.full_slice_s:.3f} s)"
            )
        return "\n".join(lines)


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def load_bench_model(model: str | Path | None) -> tuple[str, Any]:
    """The bench model: ``model`` if given (a fetched model's name such as ``smollm2``, or
    any mlx-lm model directory), else the default."""
    from mlx_recovery_plugin.models.library import resolve_model
    from mlx_recovery_plugin.testing.tiny_model import BENCH_TARGET, cached_model_dir, load_tiny_model

    model_dir = cached_model_dir(BENCH_TARGET) if model is None else resolve_model(model)
    loaded, _ = load_tiny_model(model_dir)
    return str(model if model is not None else model_dir), loaded


def bench_tokens(n: int, vocab: int = 256, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 131 + (i * i) % 17) % vocab for i in range(n)]


def plain_prefill(handle: BenchHandle, tokens: Sequence[int], chunk: int) -> list[Any]:
    """mlx-lm's own prefill loop: one chunk, evaluate the cache, free the buffer cache."""
    cache = handle.make_cache()
    for start in range(0, len(tokens), chunk):
        handle.model(mx.array(tokens[start : start + chunk])[None], cache=cache)
        mx.eval(cache_arrays(cache))
        mx.clear_cache()
    return cache


def _runner_prefill(
    runner: SliceRunner, tokens: Sequence[int], chunk: int
) -> tuple[Any, list[BlockState]]:
    live = runner.begin(tokens)
    published: list[BlockState] = []
    while live.offset < len(tokens):
        out = runner.advance(live, min(len(tokens), live.offset + chunk), lambda: False)
        published += out.blocks  # handed off, held as a host's store would
    return live, published


def _measure(fn: Callable[[], Any]) -> tuple[float, int, int, Any]:
    """Seconds, peak bytes above start, bytes still held above start, and fn's result."""
    mx.clear_cache()
    start_active = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    peak = mx.get_peak_memory() - start_active
    held = mx.get_active_memory() - start_active
    return seconds, peak, held, result


def run_runner_bench(
    model_dir: str | Path | None = None,
    *,
    tokens: int = 2048,
    slice_tokens: int = 512,
    block_size: int = 256,
    repeats: int = 5,
    arrivals: int = 5,
    interruptible: bool = True,
    out: Callable[[str], None] = print,
) -> RunnerBenchResult:
    """Measure the runner against plain mlx-lm prefill; see the module docstring."""
    name, model = load_bench_model(model_dir)
    handle = BenchHandle(name, model)
    prompt = bench_tokens(tokens)
    runner = SliceRunner(handle, block_size, interruptible=interruptible)
    result = RunnerBenchResult(blas.describe(), name, tokens, slice_tokens, block_size)
    out(f"warming up ({blas.describe()}) ...")
    plain_prefill(handle, prompt[: slice_tokens + 1], slice_tokens)
    _runner_prefill(runner, prompt[: slice_tokens + 1], slice_tokens)
    balance, result.balance_line = measure_or_say_why(model, tokens)
    result.balance = balance.as_dict() if balance is not None else None
    out(result.balance_line)

    for repeat in range(repeats):
        order = ("plain", "runner") if repeat % 2 == 0 else ("runner", "plain")
        for arm in order:
            if arm == "plain":
                s, peak, held, _ = _measure(lambda: plain_prefill(handle, prompt, slice_tokens))
                result.plain_tps.append(tokens / s)
                result.plain_peak_extra.append(peak)
                result.plain_transient.append(peak - held)
            else:
                s, peak, _, (_, published) = _measure(
                    lambda: _runner_prefill(runner, prompt, slice_tokens)
                )
                result.runner_tps.append(tokens / s)
                result.runner_peak_extra.append(peak)
                result.published_bytes = sum(b.nbytes for b in published)
                del published
            mx.clear_cache()
        out(
            f"repeat {repeat + 1}/{repeats}: plain {result.plain_tps[-1]:.0f} tok/s, "
            f"runner {result.runner_tps[-1]:.0f} tok/s"
        )
    if arrivals > 0:
        _arrival_waits(handle, prompt, slice_tokens, block_size, arrivals, result)
    return result


def _arrival_waits(
    handle: BenchHandle,
    prompt: Sequence[int],
    slice_tokens: int,
    block_size: int,
    arrivals: int,
    result: RunnerBenchResult,
) -> None:
    """Arrivals at evenly spread moments of one slice, after half the prompt."""
    boundary = (len(prompt) // 2 // block_size) * block_size
    end = min(len(prompt), boundary + slice_tokens)
    whole = SliceRunner(handle, block_size, interruptible=False)
    gated = SliceRunner(handle, block_size, interruptible=True)
    _, blocks = _runner_prefill(whole, prompt[:boundary], slice_tokens)
    prefix = FetchedPrefix(boundary, tuple(blocks))

    def one(runner: SliceRunner, arrive_after: float | None) -> float:
        live = runner.begin(prompt, prefix)
        started = time.perf_counter()
        arrival = started + (arrive_after if arrive_after is not None else 1e9)
        runner.advance(live, end, lambda: time.perf_counter() >= arrival)
        returned = time.perf_counter()
        runner.discard(live)
        return returned - started if arrive_after is None else max(0.0, returned - arrival)

    result.full_slice_s = statistics.median(one(whole, None) for _ in range(3))
    for i in range(arrivals):
        at = result.full_slice_s * (i + 0.5) / arrivals
        result.wait_whole_slice_s.append(one(whole, at))
        result.wait_interruptible_s.append(one(gated, at))


# -- command line ------------------------------------------------------------------------


def _configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, metavar="NAME|PATH",
        help="a fetched model's name (smollm2) or an mlx-lm model dir (default: BENCH_TARGET, two random "
        "float32 llama layers of hidden 4,096, feed-forward 11,008)")
    add("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    add("--slice", type=int, default=512, dest="slice_tokens",
        help="tokens per slice and per plain chunk (default 512)")
    add("--block", type=int, default=256, dest="block_size", help="cache block size (default 256)")
    add("--repeats", type=int, default=5, help="alternating repeats (default 5)")
    add("--arrivals", type=int, default=5, help="arrival-wait samples per mode (0: skip)")
    add("--no-interruptible", action="store_false", dest="interruptible",
        help="run the runner arm without stop checks")
    add_openblas_flag(parser)


def add_parser(subparsers: Any) -> None:
    """Add ``runner`` to the lab's suites (``python tests/lab runner``; handler in ``func``)."""
    parser = subparsers.add_parser(
        "runner", help="recovery runner vs plain mlx-lm prefill: throughput, memory, arrival wait"
    )
    _configure(parser)
    parser.set_defaults(func=handle_args)


def handle_args(args: argparse.Namespace) -> int:
    maybe_reexec(args)
    result = run_runner_bench(
        args.model,
        tokens=args.tokens,
        slice_tokens=args.slice_tokens,
        block_size=args.block_size,
        repeats=args.repeats,
        arrivals=args.arrivals,
        interruptible=args.interruptible,
    )
    print(result.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/lab runner", description=(__doc__ or "").split("\n\n")[0]
    )
    _configure(parser)
    return handle_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
