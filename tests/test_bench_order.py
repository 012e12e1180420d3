"""The order bench at toy size: every arm serves the schedule, and the report says on what."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lab import order
from lab.cli import build_parser
from mlx_recovery_plugin.demo.arms import Models
from mlx_recovery_plugin.recovery import service
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec


def job_order() -> tuple[float, bool, bool]:
    """The service's order switches, as the recency arm sets them."""
    return service.CLEARLY_MORE, service.FINISH_IN_HAND, service.DUE_FIRST


TOY = order.OrderSchedule(a_tokens=512, b_tokens=448, append_tokens=64, sparse_threshold=384, block_size=64)


def test_every_arm_serves_both_returns_and_the_recency_arm_leaves_the_order_as_it_was(
    loaded: tuple[Any, Any, Any],
) -> None:
    model, tokenizer, draft = loaded
    shipped = job_order()
    lines: list[str] = []
    tiny = TinyModelSpec(arch="llama", seed=0)  # the shape of the `loaded` fixture's model
    report = order.run_order_bench(
        TOY, repeats=1, models=Models(model, tokenizer, draft), progress=lines.append, target=tiny,
    )

    (runs,) = report.runs
    assert sorted(runs) == sorted((*order.ORDERINGS, *order.BASELINES))
    for arm, run in runs.items():
        assert [(r.name, r.prompt_tokens) for r in run.returns] == [("A", 576), ("B", 512)], arm
    # The baselines bound the arms: sparse off restores each whole first prompt, sparse on nothing.
    assert [r.cached_tokens for r in runs["sparse_off"].returns] == [512, 448]
    assert runs["sparse_off"].restorable_at_a_return == {"A": 512, "B": 448}
    assert [r.cached_tokens for r in runs["sparse_on"].returns] == [0, 0]
    assert [r.route for r in runs["sparse_on"].returns] == ["sparse", "sparse"]
    assert job_order() == shipped
    assert len(lines) == 2 + 4, "the balance, the gaps, then one line per arm"

    text = order.format_report(report)
    assert "BLAS:" in text and f"({order.shape_text(tiny)}, float32" in text
    assert "default / recency" in text and "recency / sparse on" in text


def test_the_recency_arm_turns_off_every_rule_that_is_not_recency() -> None:
    with order.ordering("recency"):
        assert job_order() == (math.inf, False, False)
    with order.ordering("default"):
        clearly_more, in_hand, due_first = job_order()
        assert in_hand and due_first and math.isfinite(clearly_more)


def test_target_takes_a_shape_as_bench_server_does_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["order", "--target", "2048x4x5632x16x4x128"])
    spec = args.target
    assert (spec.hidden_size, spec.num_layers, spec.intermediate_size, spec.num_heads, spec.num_kv_heads) == (
        2048, 4, 5632, 16, 4)
    assert dict(spec.extra)["head_dim"] == 128
    assert (spec.seed, spec.dtype) == (order.ORDER_TARGET.seed, "float32")
    assert order.shape_text(spec) == "2048x4x5632x16x4x128"
    defaults = build_parser().parse_args(["order"])
    assert defaults.target == order.ORDER_TARGET
    assert order.OrderSchedule(b_share=defaults.b_share) == order.OrderSchedule()

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["order", "--target", "2048x4x5632x6x4"])
    assert exc.value.code == 2
    assert "key/value heads divide heads" in capsys.readouterr().err
