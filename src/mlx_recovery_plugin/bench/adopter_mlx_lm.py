"""``mlx-recovery bench adopter --host mlx_lm``: the adopter on mlx-lm's own server, over HTTP.

Each model kind (a qwen3_next-shaped hybrid, a gemma3-shaped sliding-window model, a qwen3
trimmable reference; tiny random-weight float32 models) is served by ``python -m
mlx_lm.server`` without the plugin and with it (attached from the environment alone), and
driven by a client (the OpenAI SDK when installed, else plain ``urllib``) through five
workloads: a shared document inside one user message, ``/v1/completions`` with a shared
prefix, an edited user message, sub-agents with different system prompts over one shared
tool schema (the schema leads the system message: the tiny models' template renders no
tool list), and a regenerated answer (:mod:`.mlx_lm_workloads`). Each workload uses its
own text, so one server per arm serves them all without cross-talk.

Per workload and arm: cached tokens as the server's ``usage.prompt_tokens_details.
cached_tokens`` reports them, summed over every request after the first; the *floor* is
the sum of ``floor(shared prefix, block)`` where the shared prefix is the longest common
prefix with any earlier prompt of the workload (what a block-floored adopter could
restore); snapshot bytes held at the workload's end and stored during it (from the
plugin's status route); each request's time to first token, streamed and timed by the
client from sending the request to its first streamed content, and their median over the
requests after the first (the first of a workload has nothing to reuse in either arm).
The two arms are two servers run one after the other, so their first-token ratio holds
the machine's drift between them, and a tiny model's prefill is short beside the HTTP
round trip: read it as a ratio per workload, with the regenerated answer (the server's
own reuse in both arms) as the control. The host's own time to first token on requests
the adopter does not adopt is measured apart, in one process with the adapter attached
and not in alternating pairs (:mod:`.mlx_lm_untouched`). Timing: take it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..testing.mlx_lm_models import SPECS
from ..testing.mlx_lm_server import plugin_environment, serving
from ..testing.tiny_model import cached_model_dir
from .mlx_lm_long_run import LongRun, run_long_run
from .mlx_lm_untouched import UntouchedRow, format_rows
from .mlx_lm_untouched import measure as measure_untouched
from .mlx_lm_workloads import PARTIAL_WORKLOADS, WORKLOADS, floor_tokens, sdk_sender, urllib_sender, workload

ARMS = ("without", "with")
GOAL_SHARE = 0.9


@dataclass(slots=True)
class Row:
    model: str
    workload: str
    arm: str
    requests: int
    cached_tokens: int
    floor_tokens: int
    snapshot_bytes: int = 0
    snapshot_bytes_stored: int = 0
    cuts: int = 0
    host_cache_bytes: int = 0
    texts: list[str] = field(default_factory=list)
    #: Each request's seconds to its first streamed content, in the order sent.
    ttft_s: list[float] = field(default_factory=list)

    @property
    def share_of_floor(self) -> float:
        return self.cached_tokens / self.floor_tokens if self.floor_tokens else 1.0

    @property
    def ttft_median_s(self) -> float | None:
        """Median time to first token over the requests after the first (None with one)."""
        later = self.ttft_s[1:]
        return statistics.median(later) if later else None


def kv_bytes_per_token(model: str) -> int:
    """Bytes per token of the model's trimmable (attention) layers, measured on 256 tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from ..testing.tiny_model import load_tiny_model

    loaded, _ = load_tiny_model(cached_model_dir(SPECS[model]))
    cache = make_prompt_cache(loaded)
    mx.eval(loaded(mx.array([[1] * 256]), cache=cache))
    return int(sum(c.nbytes for c in cache if type(c) is KVCache)) // 256


def run_arm(
    model: str, arm: str, *, block: int, doc_chars: int, requests: int, seed: int, use_sdk: bool,
    workloads: Sequence[str] = WORKLOADS,
) -> list[Row]:
    path = cached_model_dir(SPECS[model])
    rows: list[Row] = []
    with serving(path, plugin_environment(arm == "with", block)) as client:
        send = (sdk_sender(client) if use_sdk else None) or urllib_sender(client)
        before = client.status() or {}
        for name in workloads:
            batch = workload(name, doc_chars, requests, seed)
            replies = [send(r) for r in batch]
            after = client.status() or {}
            snaps, snaps_before = after.get("snapshots", {}), before.get("snapshots", {})
            rows.append(Row(
                model, name, arm, len(batch), sum(r.cached_tokens for r in replies[1:]), floor_tokens(batch, block),
                snapshot_bytes=int(snaps.get("bytes", 0)),
                snapshot_bytes_stored=int(snaps.get("bytes_stored", 0)) - int(snaps_before.get("bytes_stored", 0)),
                cuts=int(after.get("cuts", 0)) - int(before.get("cuts", 0)),
                host_cache_bytes=int(after.get("host_cache_bytes", 0)),
                texts=[r.text for r in replies],
                ttft_s=[r.ttft_s for r in replies if r.ttft_s is not None],
            ))
            before = after
    return rows


@dataclass(slots=True)
class MlxLmBenchReport:
    block: int
    doc_chars: int
    rows: list[Row] = field(default_factory=list)

    kv_per_token: dict[str, int] = field(default_factory=dict)
    #: Time to first token on fresh prompts, adapter attached / not (empty: not measured).
    untouched: list[UntouchedRow] = field(default_factory=list)
    #: The snapshot budget under a long run, per non-trimmable model (empty: not run).
    long_run: list[LongRun] = field(default_factory=list)
    blas: str = ""

    def row(self, model: str, workload: str, arm: str) -> Row | None:
        return next((r for r in self.rows if (r.model, r.workload, r.arm) == (model, workload, arm)), None)

    def memory_ratio(self, model: str, workload: str) -> float | None:
        """Snapshot bytes stored over the KV bytes of the tokens they let the host skip."""
        off, on = self.row(model, workload, "without"), self.row(model, workload, "with")
        if off is None or on is None or on.cached_tokens <= off.cached_tokens:
            return None
        return on.snapshot_bytes_stored / ((on.cached_tokens - off.cached_tokens) * self.kv_per_token[model])

    def ttft_ratio(self, model: str, workload: str) -> float | None:
        """Median time to first token with the adopter over without (requests after the first)."""
        off, on = self.row(model, workload, "without"), self.row(model, workload, "with")
        if off is None or on is None or off.ttft_median_s is None or on.ttft_median_s is None:
            return None
        return on.ttft_median_s / off.ttft_median_s if off.ttft_median_s > 0 else None

    @property
    def goals_met(self) -> bool:
        partial = all(r.share_of_floor >= GOAL_SHARE for r in self.rows
                      if r.arm == "with" and r.model != "reference" and r.workload in PARTIAL_WORKLOADS)
        reference_free = all(r.snapshot_bytes_stored == 0 and r.cuts == 0 for r in self.rows if r.model == "reference")
        return partial and reference_free and all(run.goal_met for run in self.long_run)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": "mlx_lm", "block_tokens": self.block, "doc_chars": self.doc_chars, "blas": self.blas,
            "kv_bytes_per_token": self.kv_per_token,
            "rows": [{**asdict(r), "share_of_floor": round(r.share_of_floor, 3), "ttft_median_s": r.ttft_median_s,
                      "snapshot_over_kv_saved": self.memory_ratio(r.model, r.workload) if r.arm == "with" else None,
                      "ttft_with_over_without": self.ttft_ratio(r.model, r.workload) if r.arm == "with" else None}
                     for r in self.rows],
            "goals_met": self.goals_met,
            "untouched_ttft": [r.to_dict() for r in self.untouched],
            "long_run": [run.to_dict() for run in self.long_run],
        }

    def format_table(self) -> str:
        lines = [f"mlx_lm.server, cached tokens per workload (block {self.block}; floor = block floor of the shared prefix; "
                 f"{self.blas or 'BLAS not recorded'})",
                 f"  {'workload':<19} {'model':<9} {'without':>8} {'with':>8} {'floor':>8} {'share':>6} "
                 f"{'snap held':>10} {'snap stored':>11} {'cuts':>5} {'snap/KV saved':>13} "
                 f"{'TTFT w/o ms':>11} {'with ms':>8} {'ratio':>6}"]
        for name in dict.fromkeys(r.workload for r in self.rows):
            for model in dict.fromkeys(r.model for r in self.rows):
                off, on = self.row(model, name, "without"), self.row(model, name, "with")
                if on is None:
                    continue
                lines.append(
                    f"  {name:<19} {model:<9} {off.cached_tokens if off else '-':>8} {on.cached_tokens:>8} "
                    f"{on.floor_tokens:>8} {on.share_of_floor:>6.0%} {on.snapshot_bytes:>10} "
                    f"{on.snapshot_bytes_stored:>11} {on.cuts:>5} {_ratio(self.memory_ratio(model, name)):>13} "
                    f"{_ms(off.ttft_median_s if off else None):>11} {_ms(on.ttft_median_s):>8} "
                    f"{_ratio(self.ttft_ratio(model, name)):>6}"
                )
        lines.append("TTFT: median over the requests after the first, streamed, client-side")
        lines.extend(run.describe() for run in self.long_run)
        lines.append(f"goals met (with >= {GOAL_SHARE:.0%} of floor on partial workloads; reference: 0 cuts, 0 bytes"
                     f"{'; long run within budget, late siblings adopted' if self.long_run else ''}): "
                     f"{'yes' if self.goals_met else 'no'}")
        if self.untouched:
            lines.append(format_rows(self.untouched))
        return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def run_mlx_lm_bench(
    *, block: int = 64, doc_chars: int = 600, requests: int = 3, seed: int = 0, use_sdk: bool = True,
    models: Sequence[str] = ("hybrid", "sliding", "reference"), workloads: Sequence[str] = WORKLOADS,
    untouched_pairs: int = 0, untouched_tokens: int = 1500, long_run_documents: int = 0, long_run_snapshots: int = 4,
) -> MlxLmBenchReport:
    from ..runner.blas import describe

    report = MlxLmBenchReport(block, doc_chars, blas=describe())
    if untouched_pairs > 0:  # first, before the servers below load the machine
        report.untouched = measure_untouched(("reference", *[m for m in models if m != "reference"]), block=block,
                                             pairs=untouched_pairs, prompt_tokens=untouched_tokens, seed=seed)
    for model in models:
        report.kv_per_token[model] = kv_bytes_per_token(model)
        arms = ("with",) if model == "reference" else ARMS
        for arm in arms:
            report.rows += run_arm(model, arm, block=block, doc_chars=doc_chars, requests=requests, seed=seed,
                                   use_sdk=use_sdk, workloads=workloads)
    if long_run_documents > 0:  # last: it times nothing
        report.long_run = [run_long_run(m, documents=long_run_documents, doc_chars=doc_chars, block=block,
                                        budget_snapshots=long_run_snapshots, seed=seed, use_sdk=use_sdk)
                           for m in models if m != "reference"]
    return report


def command(args: argparse.Namespace) -> int:
    report = run_mlx_lm_bench(block=args.block_size, doc_chars=args.system_tokens, requests=args.requests,
                              seed=args.seed, use_sdk=not args.urllib,
                              untouched_pairs=getattr(args, "untouched_pairs", 0),
                              untouched_tokens=getattr(args, "untouched_tokens", 1500),
                              long_run_documents=getattr(args, "long_run", 0),
                              long_run_snapshots=getattr(args, "long_run_snapshots", 4))
    text = json.dumps(report.to_dict(), indent=1) if args.json else report.format_table()
    if args.out:
        Path(args.out).write_text(json.dumps(report.to_dict(), indent=1))
    if getattr(args, "plot", None):
        from .adopter_mlx_lm_plot import write_plot

        write_plot(report, args.plot)
    print(text)
    return 0 if report.goals_met else 1
