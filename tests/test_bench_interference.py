"""The interference bench at toy size: it measures an arrival during real recovery."""

from __future__ import annotations

from mlx_recovery_plugin.bench.interference import format_rows, run_interference_bench
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model


def test_interference_bench_reports_every_configuration(tiny_llama_dir, tiny_draft_dir) -> None:
    model, tokenizer = load_tiny_model(tiny_llama_dir)
    draft, _ = load_tiny_model(tiny_draft_dir)
    lines: list[str] = []
    report = run_interference_bench(
        slice_sizes=(128,), trials=1, context=1024, probe_len=16, block_size=64,
        models=(model, tokenizer, draft), progress=lines.append,
    )
    rows = report.rows
    assert [(r.slice_tokens, r.interruptible) for r in rows] == [(128, True), (128, False)]
    assert all(r.extra_wait.low >= 0 for r in rows)
    assert rows[1].slice_seconds > 0  # a whole slice ran and was timed
    assert len(lines) == 3 and lines[0].startswith("cost balance: a token at 1,024 context")
    assert "longest slice" in lines[1]
    table = format_rows(report)
    assert "worst/slice" in table and report.balance_line in table
