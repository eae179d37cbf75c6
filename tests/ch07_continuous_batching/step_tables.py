"""Step tables: run a scenario on the step-level engine and check its state at chosen steps.

Steps are numbered from 1: "step k" is the state right after the k-th call of `engine.step()`.
A request arriving at step k is added just before that call, and so is an abort at step k.
"""

from dataclasses import dataclass, field

from tests.engine_options import no_prefix_caching


@dataclass
class Scenario:
    prompt_lens: list[int]
    max_tokens: list[int]
    arrival_steps: list[int]
    max_num_seqs: int = 4
    block_size: int = 4
    num_kv_blocks: int = 16
    max_num_batched_tokens: int | None = None
    aborts: dict[int, list[str]] = field(default_factory=dict)  # step -> request ids aborted before it


def prompt_tokens(index: int, length: int) -> list[int]:
    return [(index * 37 + j * 11) % 300 + 3 for j in range(length)]


def whole_prompts(checkpoint) -> dict:
    """The options that keep chapter 07's scheduling: from chapter 08 on, chunked prefill turned off (a
    prompt must fit what a step's token budget has left, or wait), and prefix caching off."""
    if "chunked_prefill" not in checkpoint.__capabilities__:
        return {}
    return {"enable_chunked_prefill": False, **no_prefix_caching(checkpoint)}


def make_engine(checkpoint, model_dir, scenario: Scenario):
    return checkpoint.LLMEngine(
        str(model_dir),
        max_num_seqs=scenario.max_num_seqs,
        block_size=scenario.block_size,
        num_kv_blocks=scenario.num_kv_blocks,
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        watermark=0.0,
        **whole_prompts(checkpoint),
    )


def observe(engine, outputs) -> dict:
    manager = engine.block_manager
    return {
        "waiting": [seq.request_id for seq in engine.scheduler.waiting],
        "running": [seq.request_id for seq in engine.scheduler.running],
        "outputs": [output.request_id for output in outputs],
        "finished": [output.request_id for output in outputs if output.finished],
        "used_blocks": manager.num_total_blocks - manager.num_free_blocks,
        "free_blocks": manager.num_free_blocks,
    }


def run_step_table(checkpoint, model_dir, scenario: Scenario, table: dict[int, dict]) -> dict[str, list[int]]:
    """Run `scenario` to the end, asserting every field listed in `table[step]`; return each request's
    generated tokens (greedy, EOS ignored, so lengths are exactly max_tokens)."""
    engine = make_engine(checkpoint, model_dir, scenario)
    results: dict[str, list[int]] = {}
    last_arrival = max(scenario.arrival_steps)
    step = 0
    while step < last_arrival or engine.has_unfinished_requests():
        step += 1
        for index, arrival in enumerate(scenario.arrival_steps):
            if arrival == step:
                params = checkpoint.SamplingParams(
                    temperature=0, max_tokens=scenario.max_tokens[index], ignore_eos=True
                )
                engine.add_request(str(index), prompt_tokens(index, scenario.prompt_lens[index]), params)
        for request_id in scenario.aborts.get(step, []):
            assert engine.abort_request(request_id)
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                results[output.request_id] = list(output.token_ids)
        state = observe(engine, outputs)
        for name, expected in table.get(step, {}).items():
            assert state[name] == expected, f"step {step}, {name}: {state[name]} != {expected} (state {state})"
        assert step < 1000, "the scenario does not end"
    assert set(table) <= set(range(1, step + 1)), f"the table lists steps after the last one ({step})"
    assert engine.block_manager.num_free_blocks == scenario.num_kv_blocks
    return results
