"""The efficiency bench at toy size: it measures, and reports what it measured."""

from __future__ import annotations

from pathlib import Path

from lab.efficiency import format_rows, run_efficiency_bench
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model


def test_efficiency_rows_cover_every_budget_and_commit_the_whole_prompt(tiny_llama_dir: Path, tiny_draft_dir: Path) -> None:
    models = (load_tiny_model(tiny_llama_dir)[0], load_tiny_model(tiny_draft_dir)[0])
    lines: list[str] = []
    rows = run_efficiency_bench(
        ((5.0, 1.0), (50.0, 10.0)), tokens=512, block_size=64, slice_tokens=128, repeats=1,
        models=models, progress=lines.append,
    )
    assert [(r.pct, r.window_s) for r in rows] == [(5.0, 1.0), (50.0, 10.0)]
    for row in rows:
        assert row.committed == [512]
        assert row.efficiencies[0] > 0
        assert row.work_kept == [1.0], "no slice's work was thrown away"
    assert len(lines) == 2
    table = format_rows(rows)
    assert "BLAS:" in table and "committed / run" in table
