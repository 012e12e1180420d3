"""The adopter bench: the clone arm reaches the block-floor optimum on every workload,
the plain path gets nothing from partial matches, and the subcommand prints its report."""

from __future__ import annotations

import argparse
import json

import pytest

from mlx_recovery_plugin.bench.adopter import add_parser, run_adopter_bench


@pytest.fixture(scope="module")
def report():
    return run_adopter_bench(system_tokens=200, requests=8, entries=50, lookups=100, entry_tokens=64)


def test_clone_arm_reaches_the_block_floor_optimum_on_every_workload(report) -> None:
    clone = [r for r in report.rows if r.arm == "clone"]
    assert {r.workload for r in clone} == {"siblings", "multi-turn", "burst"}
    for row in clone:
        assert row.optimum_tokens > 0 and row.cached_tokens == row.optimum_tokens, row


def test_plain_path_reuses_nothing_on_partial_match_workloads(report) -> None:
    assert all(r.cached_tokens == 0 for r in report.rows if r.arm == "plain")


def test_trim_arm_loses_the_burst_to_its_one_shot_take(report) -> None:
    (burst,) = [r for r in report.rows if r.arm == "trim" and r.workload == "burst"]
    assert 0 < burst.cached_tokens == burst.optimum_tokens // burst.requests


def test_decision_cost_is_measured_over_the_stored_entries(report) -> None:
    d = report.decision
    assert d is not None and (d.entries, d.lookups) == (50, 100)
    assert 0 < d.adopted <= 100 and 0 < d.median_us <= d.p99_us <= d.max_us


def test_unknown_arm_is_rejected_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="plain, clone, trim"):
        run_adopter_bench(arms=("dense",), entries=0)


def test_subcommand_prints_a_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="suite"))
    args = parser.parse_args(
        ["adopter", "--system-tokens", "64", "--requests", "3", "--entries", "20", "--lookups", "20", "--json"]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {w["arm"] for w in out["workloads"]} == {"plain", "clone", "trim"}
    assert out["decision_cost"]["entries"] == 20
