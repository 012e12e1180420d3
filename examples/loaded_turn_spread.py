"""How widely a cached dense append's time spreads under a competing CPU load, with the
prefix cached by the host's own dense prefill and with it published by recovery.

``bench policy --load-at next`` judged a published turn slow (1024x2: 2.99 s with 8,704
tokens restored, against 0.90-1.12 s for the dense arm's two cached appends under the
same load). This script tells a slow publication from the load's spread: on oMLX's
scheduler in process it alternates two arms, each serving a sparse-free (``sparse_off``)
or sparse-and-recovered (``sparse_recovery``) first turn of 8,704 tokens on a quiet
machine, then ``--turns`` next turns of +600 tokens (each over the whole cached prefix)
with one busy process per core, then one more with the machine quiet again.

    python examples/loaded_turn_spread.py [--rounds 4] [--turns 3] [--json FILE]

It writes a random-weight float32 llama (``bench policy``'s 1024x2 shape, seed 30) unless
``--model-dir`` holds one. Run it alone on the machine, in the environment with oMLX
(``.venv-omlx``), and say which BLAS MLX used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mlx_recovery_plugin.bench.policy.cells import full_matrix, parse_shape
from mlx_recovery_plugin.bench.policy.load import CompetingLoad
from mlx_recovery_plugin.bench.policy.measure import IDLE_CAP_S, LOAD_SETTLE_S, SETTLE_S, serve_config, tokens
from mlx_recovery_plugin.bench.server.models import spec_id
from mlx_recovery_plugin.demo.omlx import OmlxArm
from mlx_recovery_plugin.runner import blas
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model, write_tiny_model

CONTEXT = 8704
APPEND = 600
ARMS = ("sparse_off", "sparse_recovery")


def _turn(row: Any) -> dict[str, Any]:
    return {"ttft_s": row.ttft_s, "cached": row.cached_tokens, "route": row.route}


def run_arm(arm_name: str, models: tuple[Any, Any, Any], config: Any, round_: int, turns: int) -> dict[str, Any]:
    model, tokenizer, draft = models
    base = tokens(CONTEXT, CONTEXT)
    with tempfile.TemporaryDirectory() as root:
        arm = OmlxArm(arm_name, model, tokenizer, draft, config, Path(root) / arm_name)
        try:
            arm.serve(base, 0)
            arm.think(IDLE_CAP_S if arm.plugin is not None else SETTLE_S)
            loaded: list[dict[str, Any]] = []
            with CompetingLoad():
                time.sleep(LOAD_SETTLE_S)
                for k in range(turns):
                    row = arm.serve(base + tokens(APPEND, 9000 + 10 * round_ + k), k + 1).row
                    arm.think(SETTLE_S)
                    loaded.append(_turn(row))
            time.sleep(LOAD_SETTLE_S)
            row = arm.serve(base + tokens(APPEND, 9500 + round_), turns + 1).row
            arm.think(SETTLE_S)
            quiet = _turn(row)
        finally:
            arm.close()
    return {"arm": arm_name, "round": round_, "loaded": loaded, "quiet": quiet}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="where the models are (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    shape = parse_shape("1024x2x2048x4x1", 30)
    matrix = full_matrix(shapes=(shape,), contexts=(CONTEXT,), loads=(True,), load_at="next")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir or Path(tmp)
        paths = {"target": root / spec_id(shape), "draft": root / ("draft-" + spec_id(matrix.draft))}
        for path, spec in ((paths["target"], shape), (paths["draft"], matrix.draft)):
            if not (path / "model.safetensors").exists():
                write_tiny_model(path, spec)
        model, tokenizer = load_tiny_model(paths["target"])
        draft, _ = load_tiny_model(paths["draft"])
        config = serve_config(matrix, 50.0)
        runs = []
        for round_ in range(args.rounds):
            for arm_name in ARMS if round_ % 2 == 0 else ARMS[::-1]:
                run = run_arm(arm_name, (model, tokenizer, draft), config, round_, args.turns)
                runs.append(run)
                print(arm_name, round_, [f"{t['ttft_s']:.2f}" for t in run["loaded"]],
                      f"quiet {run['quiet']['ttft_s']:.2f}", flush=True)
    summary = {}
    for arm_name in ARMS:
        loaded = [t["ttft_s"] for r in runs if r["arm"] == arm_name for t in r["loaded"]]
        quiet = [r["quiet"]["ttft_s"] for r in runs if r["arm"] == arm_name]
        summary[arm_name] = {"loaded_median_s": statistics.median(loaded), "loaded_range_s": [min(loaded), max(loaded)],
                             "quiet_median_s": statistics.median(quiet), "quiet_range_s": [min(quiet), max(quiet)]}
        print(f"{arm_name}: loaded median {statistics.median(loaded):.2f} s ({min(loaded):.2f}-{max(loaded):.2f}), "
              f"quiet {statistics.median(quiet):.2f} s ({min(quiet):.2f}-{max(quiet):.2f})")
    ratio = summary["sparse_recovery"]["loaded_median_s"] / summary["sparse_off"]["loaded_median_s"]
    print(f"recovered / host-cached, loaded medians: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"blas": blas.describe(), "context": CONTEXT, "append": APPEND,
                                         "summary": summary, "recovered_over_host_cached": ratio,
                                         "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
