"""The recovery state machine (testing/machines/recovery.py), derandomized: the same cases
on every run, so a kill never depends on luck. `python tests/lab machines` runs it
wider with fresh random cases."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from lab.machines.recovery import run_recovery_machine
from mlx_recovery_plugin.testing.tiny_model import load_tiny_model


def test_random_interleavings_keep_the_recovery_invariants(tiny_llama_dir, tiny_draft_dir) -> None:
    model, tokenizer = load_tiny_model(tiny_llama_dir)
    draft, _ = load_tiny_model(tiny_draft_dir)
    run_recovery_machine(
        (model, tokenizer, draft),
        settings(
            max_examples=25,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            derandomize=True,
        ),
    )
