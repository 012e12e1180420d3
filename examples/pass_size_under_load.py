"""How much a competing CPU load slows a short dense pass and a long one.

The publish policy carries a sparse turn timed under load to a quiet machine (and back) by
the milder of two estimates (README, "load regime"): how its own slices' costs compare
between the regimes, and the CPU's fair share. This script measures why the first one
overstates the change for a host's turn: the slices run under load are short passes,
and contention slows a short pass more than the long one a host's prefill runs.

    python examples/pass_size_under_load.py [--model-dir DIR] [--pairs 4]

It writes a random-weight float32 llama (1024 wide, 8 layers, as ``bench policy``'s
second shape) unless ``--model-dir`` holds one, and times passes of 256 and 2,048 tokens
over 512 cached ones, quiet and with one busy process per core, alternating quiet and
loaded in pairs; it prints each size's loaded / quiet ratio per pair and their median.
Run it alone on the machine; say which BLAS MLX used (the system OpenBLAS through
``LD_PRELOAD`` makes float32 15-40x faster on Linux).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.bench.policy.load import CompetingLoad
from mlx_recovery_plugin.testing import TinyModelSpec, make_tiny_model

SPEC = TinyModelSpec(arch="llama", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                     intermediate_size=4096, seed=32)
SIZES = (256, 2048)
CACHED = 512


def per_token_s(model: object, tokens: int) -> float:
    """Seconds per token of one dense pass of ``tokens`` over ``CACHED`` cached ones."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * CACHED]), cache=cache))  # type: ignore[operator]
    started = time.perf_counter()
    mx.eval(model(mx.array([[2] * tokens]), cache=cache))  # type: ignore[operator]
    return (time.perf_counter() - started) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a model written before (default: a temp dir)")
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = make_tiny_model(args.model_dir or Path(tmp) / "model", SPEC)  # loads one written before
        for size in SIZES:  # warm up
            per_token_s(model, size)
        ratios: dict[int, list[float]] = {size: [] for size in SIZES}
        for pair in range(args.pairs):
            quiet: dict[int, float] = {}
            loaded: dict[int, float] = {}
            for is_loaded in (pair % 2 == 1, pair % 2 == 0):
                with CompetingLoad() if is_loaded else nullcontext():
                    time.sleep(0.5)  # the busy processes running
                    for size in SIZES:
                        (loaded if is_loaded else quiet)[size] = per_token_s(model, size)
            for size in SIZES:
                ratios[size].append(loaded[size] / quiet[size])
        for size in SIZES:
            spread = ", ".join(f"{r:.2f}" for r in ratios[size])
            print(f"{size:>5}-token pass: loaded / quiet {statistics.median(ratios[size]):.2f} (pairs: {spread})")


if __name__ == "__main__":
    main()
