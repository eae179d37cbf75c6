"""The chapter's benchmark workload, `python -m benchmarks prefix`, on a tiny model."""

import pytest

from tests.test_benchmarks import run_quick


@pytest.mark.workload("prefix")
def test_prefix_quick_writes_its_result_and_figure(tiny_model_dirs, tmp_path):
    result = run_quick("prefix", tiny_model_dirs["gqa"], tmp_path)
    runs = {(r["scenario"], r["caching"]): r for r in result["runs"]}
    assert set(runs) == {("shared", True), ("shared", False), ("chats", True), ("chats", False)}
    for scenario in ("shared", "chats"):
        on, off = runs[scenario, True], runs[scenario, False]
        assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
        assert 0 < on["cached_tokens"] == on["prompt_tokens"] - on["computed_prompt_tokens"]
        assert on["ttft_s"]["median"] > 0 and on["output_tokens_per_s"] > 0
