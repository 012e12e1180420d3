"""Run the matrix: write and load each shape once, then measure its cells in order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ...runner import blas
from ...testing.tiny_model import load_tiny_model, write_tiny_model
from ..server.models import spec_id
from .cells import Matrix
from .measure import measure_cell
from .report import PolicyReport


def run_matrix(
    matrix: Matrix, model_dir: Path, *, budget_pct: float = 50.0, repeats: int = 2,
    load_processes: int | None = None, progress: Callable[[str], None] = lambda line: None,
) -> PolicyReport:
    report = PolicyReport(blas=blas.describe(), budget_pct=budget_pct, repeats=repeats, threshold=matrix.threshold)
    draft_path = model_dir / ("draft-" + spec_id(matrix.draft))
    if not (draft_path / "model.safetensors").exists():
        write_tiny_model(draft_path, matrix.draft)
    draft, _ = load_tiny_model(draft_path)
    shapes = list(dict.fromkeys(cell.shape for cell in matrix.cells))
    for shape in shapes:
        path = model_dir / spec_id(shape)
        if not (path / "model.safetensors").exists():
            progress(f"writing {shape.label} to {path}")
            write_tiny_model(path, shape)
        model, tokenizer = load_tiny_model(path)
        for cell in (c for c in matrix.cells if c.shape == shape):
            progress(f"measuring {cell.label}")
            result = measure_cell(
                (model, tokenizer, draft), cell, matrix, budget_pct=budget_pct, repeats=repeats,
                seed=cell.context, load_processes=load_processes,
            )
            report.results.append(result)
            progress(f"  dense {result.dense_s:.2f} s, sparse {result.sparse_s:.2f} s ({result.truth}); "
                     f"recovery: {result.verdict}, next turn {result.recovery_turn_s:.2f} s "
                     f"({result.recovery_cached} cached)")
        del model
    return report
