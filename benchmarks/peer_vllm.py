"""vLLM's CPU build as a peer (see peer_protocol): its `LLMEngine` stepped by hand, like rosellm's, so that
each request's first and last token are timestamped. Runs in .peers/vllm with the fp32 Hugging Face folder, in
the spec's dtype (fp32 unless it says otherwise). Options that name a `speculative_config` (with
`disable_log_stats` false) also give the timed run's speculative-decoding counts, read from vLLM's metrics. A
request may carry a third item: its sampling fields beside greedy and max_tokens (`sampling_params`)."""

import itertools

from peer_protocol import Clock, serve

IDS = itertools.count()
SPEC_DECODE = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vLLM's counters vllm:spec_decode_NAME


def load(spec: dict):
    import vllm

    options = {"model": spec["model"], "dtype": spec.get("dtype", "float32"), "seed": 0, "enable_prefix_caching": False}
    options |= spec["options"]
    options["gpu_memory_utilization"] = 0.25  # on the CPU build: the share of the machine's memory for the KV cache
    return vllm.LLM(**options), {"engine": "vllm", "version": vllm.__version__, "settings": options}


def generate(llm, requests: list) -> dict:
    engine, clock, index = llm.llm_engine, Clock(len(requests)), {}
    before = spec_decode_counts(llm)
    for i, (prompt, max_tokens, *extra) in enumerate(requests):
        request_id = str(next(IDS))
        index[request_id] = i
        engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling_params(max_tokens, *extra))
    while engine.has_unfinished_requests():
        for output in engine.step():
            clock.token(index[output.request_id], output.outputs[0].token_ids if output.finished else None)
    if before is None:
        return clock.result()
    after = spec_decode_counts(llm)
    return clock.result() | {"spec_decode": {key: after[key] - before[key] for key in SPEC_DECODE}}


def sampling_params(max_tokens: int, fields: dict | None = None):
    """Greedy, EOS ignored unless `fields` (a request's third item) says otherwise; its "structured_outputs"
    are the keyword arguments of vLLM's `StructuredOutputsParams`."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    fields = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True} | (fields or {})
    if "structured_outputs" in fields:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields)


def spec_decode_counts(llm) -> dict | None:
    """vLLM's speculative-decoding counters so far (None without speculation or without its statistics)."""
    engine = llm.llm_engine
    if engine.vllm_config.speculative_config is None or not engine.log_stats:
        return None
    counters = [m for m in llm.get_metrics() if hasattr(m, "value")]
    return {key: sum(m.value for m in counters if m.name == f"vllm:spec_decode_{key}") for key in SPEC_DECODE}


if __name__ == "__main__":
    serve(load, generate)
