"""The runner benchmark runs end to end and reports a ratio (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

from lab.runner import run_runner_bench


def test_the_runner_bench_reports_ratio_memory_and_arrival_wait(tiny_llama_dir: Path) -> None:
    lines: list[str] = []
    result = run_runner_bench(
        tiny_llama_dir,
        tokens=320,
        slice_tokens=128,
        block_size=64,
        repeats=2,
        arrivals=2,
        out=lines.append,
    )
    assert len(result.ratios) == 2 and all(r > 0 for r in result.ratios)
    assert result.published_bytes > 0  # five 64-token blocks were handed off
    assert len(result.wait_interruptible_s) == len(result.wait_whole_slice_s) == 2
    summary = result.summary()
    assert result.balance is not None and result.balance["context"] == 320
    for needle in ("ratio", "peak memory", "arrival wait", "tokens/s", "cost balance: a token at 320 context"):
        assert needle in summary
    assert any(line.startswith("repeat 2/2") for line in lines)
