"""Serve one append-only agent session on the real oMLX scheduler three ways and print,
per turn, the cached tokens and time to first token: sparse route off, sparse route on,
and sparse route on with recovery.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python examples/omlx_session.py [--small] [--turns 5] [--json out.json]

Needs oMLX (flyto-mlx 0.7) in the environment. Models are the demo's random-weight float32
target and draft (written once to ~/.cache/mlx-recovery/models); ``--small`` uses the
2-layer, hidden-64 test model instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from mlx_recovery_plugin.demo.omlx import run_omlx_session
from mlx_recovery_plugin.demo.report import ARM_TITLES, ARMS
from mlx_recovery_plugin.demo.run import DemoConfig, prepare_models, session_turns
from mlx_recovery_plugin.demo.session import SessionSpec
from mlx_recovery_plugin.runner.blas import describe, warn_once_if_slow
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=6000)
    parser.add_argument("--think", type=float, default=30.0, help="idle seconds between turns")
    parser.add_argument("--budget", type=float, default=50.0, help="recovery budget, percent")
    parser.add_argument("--small", action="store_true", help="the 2-layer hidden-64 model")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    warn_once_if_slow()
    config = DemoConfig(session=SessionSpec(system_tokens=args.system_tokens, turns=args.turns, think_time_s=args.think))
    if args.small:
        config = replace(
            config,
            target=TinyModelSpec(seed=11),
            draft=TinyModelSpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=12),
        )
    config = replace(config, serve=replace(config.serve, budget_pct=args.budget))
    models = prepare_models(config)
    turns = session_turns(config.session, models.tokenizer)
    serve = config.serve
    print(f"oMLX scheduler; model {config.target.hidden_size}x{config.target.num_layers} float32; BLAS: {describe()}")
    print(f"block {serve.block_size}, sparse threshold {serve.sparse_threshold}, keep {serve.sparse_keep}, "
          f"budget {serve.budget_pct}%, think {args.think}s")
    results = run_omlx_session(models.model, models.tokenizer, models.draft, [t.prompt for t in turns], config=serve, think_time_s=args.think)

    print(f"{'turn':>4} {'tokens':>7} | " + " | ".join(f"{ARM_TITLES[a]:^24}" for a in ARMS))
    print(f"{'':>4} {'':>7} | " + " | ".join(f"{'cached':>8} {'ttft s':>7} {'route':>6}" for _ in ARMS))
    for i, turn in enumerate(turns):
        cells = []
        for arm in ARMS:
            row = results[arm].turns[i]
            cells.append(f"{row.cached_tokens:>8} {row.ttft_s:>7.3f} {row.route:>6}")
        print(f"{i + 1:>4} {len(turn.prompt):>7} | " + " | ".join(cells))
    totals = {arm: sum(t.ttft_s for t in results[arm].turns) for arm in ARMS}
    print("total time to first token: " + ", ".join(f"{ARM_TITLES[a]} {totals[a]:.2f}s" for a in ARMS))
    rec = results["sparse_recovery"]
    print(f"recovery: {rec.recovered_tokens} tokens recovered, {rec.recovery_seconds:.2f}s of idle time used")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"blas": describe(), "arms": {a: asdict(r) for a, r in results.items()}}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
