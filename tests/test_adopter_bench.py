"""The adopter bench: the clone arm reaches the block-floor optimum on every workload,
the plain path gets nothing from partial matches, the whole-block arm (as oMLX) restores
the whole blocks of every partial match, the adopter's gain is stated signed against that
arm, and the subcommand prints its report."""

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


def test_blocks_arm_restores_the_whole_blocks_of_every_partial_match(report) -> None:
    blocks = {r.workload: r for r in report.rows if r.arm == "blocks"}
    assert set(blocks) == {"siblings", "multi-turn", "burst"}
    for row in blocks.values():
        # Every request here matches part of an entry, never a whole one: all it caches
        # comes from whole blocks of partial matches, which the plain arm declines.
        assert row.optimum_tokens > 0 and row.cached_tokens == row.optimum_tokens, row
        assert row.cached_tokens % report.block_size == 0


def test_adopter_gain_is_stated_signed_against_the_blocks_arm(report) -> None:
    cached = {(r.workload, r.arm): r.cached_tokens for r in report.rows}
    gains = {(g.workload, g.arm): g for g in report.gains()}
    assert set(gains) == {(w, a) for w in ("siblings", "multi-turn", "burst") for a in ("clone", "trim")}
    for (workload, arm), g in gains.items():
        assert g.baseline_tokens == cached[(workload, "blocks")]
        assert g.tokens == cached[(workload, arm)] - cached[(workload, "blocks")]
    # Clone mode adds nothing to what whole-block matching already restores here...
    assert all(g.tokens == 0 for (_, arm), g in gains.items() if arm == "clone")
    # ...and trim mode loses the burst to its one-shot take: a negative gain, shown as such.
    assert gains[("burst", "trim")].tokens < 0
    table = report.format_table()
    assert "adopter gain over 'blocks'" in table and f"{gains[('burst', 'trim')].tokens:+d}" in table
    assert "declines every partial match" in table and "as oMLX" in table


def test_no_gain_is_stated_without_the_blocks_arm() -> None:
    report = run_adopter_bench(system_tokens=64, requests=2, entries=0, arms=("plain", "clone"))
    assert report.gains() == []
    assert "not measured" in report.format_table()


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
    with pytest.raises(ValueError, match="blocks"):
        run_adopter_bench(arms=("dense",), entries=0)


def test_subcommand_prints_a_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="suite"))
    args = parser.parse_args(
        ["adopter", "--system-tokens", "64", "--requests", "3", "--entries", "20", "--lookups", "20", "--json"]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {w["arm"] for w in out["workloads"]} == {"plain", "clone", "trim", "blocks"}
    assert set(out["arms"]) == {"plain", "clone", "trim", "blocks"}
    gains = {(g["workload"], g["arm"]): g["tokens"] for g in out["gains_vs_blocks"]}
    assert len(gains) == 6 and gains[("burst", "trim")] < 0
    assert out["decision_cost"]["entries"] == 20
