"""vLLM's CPU build as a peer (see peer_protocol): its `LLMEngine` stepped by hand, like rosellm's, so that
each request's first and last token are timestamped. Runs in .peers/vllm with the fp32 Hugging Face folder, in
the spec's dtype (fp32 unless it says otherwise)."""

import itertools

from peer_protocol import Clock, serve

IDS = itertools.count()


def load(spec: dict):
    import vllm

    options = {"model": spec["model"], "dtype": spec.get("dtype", "float32"), "seed": 0, "enable_prefix_caching": False}
    options |= spec["options"]
    options["gpu_memory_utilization"] = 0.25  # on the CPU build: the share of the machine's memory for the KV cache
    return vllm.LLM(**options), {"engine": "vllm", "version": vllm.__version__, "settings": options}


def generate(llm, requests: list) -> dict:
    from vllm import SamplingParams

    engine, clock, index = llm.llm_engine, Clock(len(requests)), {}
    for i, (prompt, max_tokens) in enumerate(requests):
        request_id = str(next(IDS))
        index[request_id] = i
        engine.add_request(
            request_id,
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
    while engine.has_unfinished_requests():
        for output in engine.step():
            clock.token(index[output.request_id], output.outputs[0].token_ids if output.finished else None)
    return clock.result()


if __name__ == "__main__":
    serve(load, generate)
