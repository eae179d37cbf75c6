"""`/metrics` renders speculative decoding's counters (vLLM's names) and the two rates they give, only when
speculation is on."""

import pytest

from chapters import submodule

pytestmark = pytest.mark.requires("speculative_decoding")

SPEC_DECODE_SAMPLES = {
    "rosellm:spec_decode_num_drafts_total": 4.0,
    "rosellm:spec_decode_num_draft_tokens_total": 10.0,
    "rosellm:spec_decode_num_accepted_tokens_total": 7.0,
    "rosellm:spec_decode_acceptance_rate": 0.7,  # 7 / 10
    "rosellm:spec_decode_mean_acceptance_length": 2.75,  # 1 + 7 / 4
}


def module_of(checkpoint, name: str):
    return submodule(checkpoint, name)


@pytest.fixture
def render(checkpoint, checkpoint_info):
    """`EngineMetrics.render()` after recording one `EngineStats` with these drafts (None: speculation off).
    One request runs, none waits: as id sets through chapter 16, as counts from chapter 17 (`metrics/stats.py`)."""
    if "subpackages" in checkpoint_info.capabilities:
        queues = {"num_running_requests": 1, "num_waiting_requests": 0}
    else:
        queues = {"running_requests": frozenset({"a"}), "waiting_requests": frozenset()}

    def rendered(spec_decode) -> str:
        stats = module_of(checkpoint, "llm_engine").EngineStats(
            **queues,
            num_free_blocks=30,
            num_total_blocks=32,
            prefix_cache_queries=16,
            prefix_cache_hits=8,
            spec_decode=spec_decode,
        )
        metrics = module_of(checkpoint, "metrics").EngineMetrics()
        metrics.record_stats(stats)
        return metrics.render()

    return rendered


def samples(text: str) -> dict[str, float]:
    """The text's samples as {name: value}."""
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def test_the_five_spec_decode_lines_with_their_values(checkpoint, render):
    text = render(module_of(checkpoint, "outputs").SpecDecodeStats(4, 10, 7))
    rendered = {name: value for name, value in samples(text).items() if "spec_decode" in name}
    assert rendered == pytest.approx(SPEC_DECODE_SAMPLES)
    for name in SPEC_DECODE_SAMPLES:
        kind = "counter" if name.endswith("_total") else "gauge"
        assert f"# TYPE {name} {kind}\n" in text
    assert samples(text)["rosellm:kv_blocks_used"] == 2  # the engine's other metrics are still there


def test_no_spec_decode_line_when_speculation_is_off(render):
    text = render(None)
    assert "spec_decode" not in text
    assert samples(text)["rosellm:kv_blocks_used"] == 2
