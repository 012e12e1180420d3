"""What a competing CPU load does to a dense pass, against what the publish policy reads.

The policy carries a sparse turn across load regimes by the mildest of three estimates
(README, "load regime"); two of them come from the machine's counters: the others'
demand (their share of what this process left them) and this process's threads'
contention (time waiting for a core over time on one, ``/proc/self/task/*/schedstat``).
This script times passes of 256 and 2,048 tokens, and 512 over 4,096 cached, quiet and
with one busy process per core, alternating, and prints beside each pass's slowdown what
the policy's ``MachineLoad`` read over it: the threads' contention, the fair share of the
others' share and their demand.

    python examples/thread_waits_under_load.py MODEL_DIR [--rounds 2]

MODEL_DIR: an mlx-lm model (``bench policy --model-dir`` writes float32 ones). Linux only.
Run it alone on the machine; say which BLAS MLX used (the system OpenBLAS through
``LD_PRELOAD`` makes float32 15-40x faster on Linux).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from contextlib import nullcontext

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.bench.policy.load import CompetingLoad
from mlx_recovery_plugin.recovery.machine_load import MachineLoad

PASSES = ((256, 0), (2048, 0), (512, 4096))
# A window shorter than this may be too short for the counters (MIN_WINDOW_S of CPU time):
# a shorter pass is repeated, each time over a fresh cache, and timed on average.
MIN_WALL_S = 0.3


def timed_pass(model: object, tokens: int, context: int) -> dict[str, float]:
    """One pass's seconds and what the policy's :class:`MachineLoad` read over it."""
    machine: MachineLoad | None = None
    passes, elapsed = 0, 0.0
    while elapsed < MIN_WALL_S:
        cache = make_prompt_cache(model)
        for _ in range(0, context, 2048):
            mx.eval(model(mx.array([[5] * 2048]), cache=cache))  # type: ignore[operator]
        machine = machine or MachineLoad()  # its window opens at the first timed pass
        start = time.perf_counter()
        mx.eval(model(mx.array([[7] * tokens]), cache=cache))  # type: ignore[operator]
        elapsed += time.perf_counter() - start
        passes += 1
    assert machine is not None
    reading = machine.reading if machine.look() is not None else None
    nan = math.nan
    return {
        "seconds": elapsed / passes,
        "threads": reading.contention if reading else nan,
        "fair_share": 1 + reading.share if reading else nan,
        "demand": 1 + reading.demand if reading else nan,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--rounds", type=int, default=2, help="quiet/loaded rounds (default 2)")
    args = p.parse_args()
    model, _ = load(args.model_dir)
    for tokens, context in PASSES:  # warm up
        timed_pass(model, tokens, context)
    rows: dict[tuple[int, int, bool], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for loaded in (False, True):
            with CompetingLoad() if loaded else nullcontext():
                time.sleep(0.3)  # the busy processes running
                for tokens, context in PASSES:
                    rows.setdefault((tokens, context, loaded), []).append(timed_pass(model, tokens, context))
    print("pass                slowed  threads  fair share  demand   (loaded; medians)")
    for tokens, context in PASSES:
        quiet = statistics.median(r["seconds"] for r in rows[(tokens, context, False)])
        busy = rows[(tokens, context, True)]
        med = {k: statistics.median(r[k] for r in busy) for k in ("seconds", "threads", "fair_share", "demand")}
        quiet_threads = statistics.median(r["threads"] for r in rows[(tokens, context, False)])
        print(f"{tokens:>5} over {context:>5}  {med['seconds'] / quiet:6.2f}x {med['threads']:7.2f}x"
              f" {med['fair_share']:10.2f}x {med['demand']:6.2f}x   (quiet threads {quiet_threads:.2f}x)")


if __name__ == "__main__":
    main()
