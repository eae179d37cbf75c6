"""The chapter's benchmark workload, `python -m benchmarks long-prompts`, on a tiny model."""

import pytest

from tests.test_benchmarks import run_quick


@pytest.mark.workload("long-prompts")
def test_long_prompts_quick_writes_its_result_and_figure(tiny_model_dirs, tmp_path):
    result = run_quick("long-prompts", tiny_model_dirs["gqa"], tmp_path)
    assert [run["budget"] for run in result["runs"]] == ["off", "16"]
    for run in result["runs"]:
        assert len(run["long_ttft_s"]) == 2 and run["decode_tpot_ms"]["p50"] > 0 and run["steps"]
