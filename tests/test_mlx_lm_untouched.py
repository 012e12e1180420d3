"""The untouched-request timing of ``bench adopter --host mlx_lm``: its report fields, not
its figures (no timing verdict in a test)."""

from __future__ import annotations

import pytest

from mlx_recovery_plugin.bench.adopter_mlx_lm import MlxLmBenchReport
from mlx_recovery_plugin.bench.mlx_lm_untouched import measure_model
from mlx_recovery_plugin.hosts.mlx_lm.instrumentor import mlx_lm_version, version_supported

if not version_supported(mlx_lm_version()):
    pytest.skip("an mlx-lm version the adapter refuses", allow_module_level=True)


def test_the_report_carries_the_untouched_ratio_with_its_spread_in_json_and_text() -> None:
    row = measure_model("hybrid", block=32, pairs=2, prompt_tokens=100, warmup=0)
    report = MlxLmBenchReport(block=32, doc_chars=0, untouched=[row])
    (out,) = report.to_dict()["untouched_ttft"]
    assert out["model"] == "hybrid" and out["pairs"] == 2
    assert len(out["with_s"]) == len(out["without_s"]) == len(out["ratios"]) == 2
    assert out["min_ratio"] <= out["iqr_ratio"][0] <= out["median_ratio"] <= out["iqr_ratio"][1] <= out["max_ratio"]
    assert isinstance(out["within_goal"], bool)
    assert out["cuts"] > 0 and out["adopted"] == 0  # fresh prompts: cut, never adopted
    assert 0 < out["capture_share"] < 1
    assert "untouched requests" in report.format_table()
