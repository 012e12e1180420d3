"""``bench adopter --host mlx_lm --plot FILE``: the report as a PNG.

One row per model: cached tokens per workload without the adopter, with it, and the block
floor of the shared prefix; beside them, the snapshot bytes stored over the KV bytes of
the tokens they saved. With a long run, a last row: the snapshot bytes held after every
request against the budget, per model. matplotlib is optional (``[plot]``); ``main``
checks it is importable before the bench starts (:mod:`..cli_checks`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .adopter_mlx_lm import MlxLmBenchReport

BARS = (("without", "without the adopter"), ("with", "with the adopter"), ("floor", "block floor"))


def write_plot(report: MlxLmBenchReport, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in report.rows))
    workloads = list(dict.fromkeys(r.workload for r in report.rows))
    n_rows = len(models) + (1 if report.long_run else 0)
    fig, axes = plt.subplots(n_rows, 2, figsize=(12, 3.1 * n_rows), squeeze=False)
    x = range(len(workloads))
    width = 0.27
    for row, model in enumerate(models):
        ax_tokens, ax_bytes = axes[row]
        for i, (key, label) in enumerate(BARS):
            values = []
            for name in workloads:
                on, off = report.row(model, name, "with"), report.row(model, name, "without")
                chosen = on if key in ("with", "floor") else off
                if chosen is None:
                    values.append(0)
                else:
                    values.append(chosen.floor_tokens if key == "floor" else chosen.cached_tokens)
            ax_tokens.bar([j + (i - 1) * width for j in x], values, width, label=label)
        ax_tokens.set(title=f"{model}: cached tokens per workload", ylabel="tokens")
        ax_tokens.set_xticks(list(x), [name.replace("_", "\n") for name in workloads], fontsize=8)
        ratios = [report.memory_ratio(model, name) for name in workloads]
        stored = sum(r.snapshot_bytes_stored for r in report.rows if r.model == model)
        if all(r is None for r in ratios):  # the reference: nothing was saved by a snapshot
            ax_bytes.axis("off")
            ax_bytes.text(0.5, 0.5, f"{model}: {stored} snapshot bytes stored, "
                          f"{sum(r.cuts for r in report.rows if r.model == model)} cuts", ha="center", fontsize=9)
            continue
        ax_bytes.bar(list(x), [r or 0.0 for r in ratios], 0.5, color="tab:purple")
        for j, r in zip(x, ratios):
            ax_bytes.text(j, r or 0.0, "-" if r is None else f"{r:.2f}x", ha="center", va="bottom", fontsize=8)
        ax_bytes.set(title=f"{model}: snapshot bytes stored over the KV of the tokens saved", ylabel="x")
        ax_bytes.set_xticks(list(x), [name.replace("_", "\n") for name in workloads], fontsize=8)
    if report.long_run:
        ax_held, ax_note = axes[n_rows - 1]
        for run in report.long_run:
            line = ax_held.plot(range(1, len(run.held_bytes) + 1), [b / run.budget_bytes for b in run.held_bytes],
                                lw=0.8, label=f"{run.model}: bytes held / budget ({run.budget_snapshots} snapshots)")
            siblings = [2 * (k + 1) for k in range(len(run.sibling_floor))]  # each document's second request
            ax_held.scatter(siblings, [c / f if f else 1.0 for c, f in zip(run.sibling_cached, run.sibling_floor)],
                            s=9, marker="x", color=line[0].get_color(), label=f"{run.model}: sibling's floor restored")
        ax_held.axhline(1.0, color="black", lw=1.0, ls="--")
        ax_held.set(title="long run: after each request", xlabel="request", ylabel="share", ylim=(0, 1.15))
        ax_note.axis("off")
        ax_note.text(0, 1, "\n\n".join(textwrap.fill(run.describe(), 70) for run in report.long_run), va="top", fontsize=8,
                     family="monospace")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, 0.985))
    if report.long_run:
        axes[n_rows - 1][0].legend(fontsize=8, loc="lower right")
    for ax in axes.flat:
        ax.grid(alpha=0.3, axis="y")
    blas = report.blas.split(" (")[0] or "BLAS not recorded"
    fig.suptitle(f"bench adopter on mlx_lm.server, block {report.block}, {report.doc_chars}-character documents, {blas}",
                 fontsize=10, y=0.998)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=80)
    plt.close(fig)

