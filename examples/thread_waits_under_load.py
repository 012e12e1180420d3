"""What a competing CPU load does to a dense pass, against what the publish policy reads.

The policy carries a sparse turn across load regimes by the mildest of three estimates
(README, "load regime"); two of them come from the machine's counters: the others'
demand (their share of what this process left them) and this process's threads'
contention (time waiting for a core over time on one, ``/proc/self/task/*/schedstat``).
This script times passes of 256 and 2,048 tokens, and 512 over 4,096 cached, quiet and
with one busy process per core, alternating, and prints beside each pass's slowdown the
threads' reading, the fair share of the others' share and their demand over the pass.

    python examples/thread_waits_under_load.py MODEL_DIR [--rounds 2]

MODEL_DIR: an mlx-lm model (``bench policy --model-dir`` writes float32 ones). Linux only.
Run it alone on the machine; say which BLAS MLX used (the system OpenBLAS through
``LD_PRELOAD`` makes float32 15-40x faster on Linux).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_recovery_plugin.recovery.machine_load import read_counters, read_thread_times

PASSES = ((256, 0), (2048, 0), (512, 4096))


def threads_total() -> tuple[float, float]:
    times = read_thread_times() or {}
    return sum(t[0] for t in times.values()), sum(t[1] for t in times.values())


def timed_pass(model: object, tokens: int, context: int) -> dict[str, float]:
    cache = make_prompt_cache(model)
    for _ in range(0, context, 2048):
        mx.eval(model(mx.array([[5] * 2048]), cache=cache))  # type: ignore[operator]
    run0, wait0 = threads_total()
    marks0 = read_counters()
    start = time.perf_counter()
    mx.eval(model(mx.array([[7] * tokens]), cache=cache))  # type: ignore[operator]
    seconds = time.perf_counter() - start
    run1, wait1 = threads_total()
    marks1 = read_counters()
    assert marks0 is not None and marks1 is not None, "no CPU counters on this system"
    busy, total, own = (b - a for a, b in zip(marks0, marks1, strict=True))
    share, own_share = max(0.0, busy - own) / total, own / total
    return {
        "seconds": seconds,
        "threads": (run1 - run0 + wait1 - wait0) / max(run1 - run0, 1e-9),
        "fair_share": 1 + share,
        "demand": 1 + min(1.0, share / max(1 - own_share, 1e-9)),
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
            load_procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(os.cpu_count() or 1)] if loaded else []
            try:
                time.sleep(0.3)
                for tokens, context in PASSES:
                    rows.setdefault((tokens, context, loaded), []).append(timed_pass(model, tokens, context))
            finally:
                for proc in load_procs:
                    proc.kill()
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
