"""The step-level engine: online arrivals, per-request sampling, abort, bad input, streaming."""

import dataclasses

import pytest

from tests.ch07_continuous_batching.step_tables import whole_prompts
from tests.oracle import hf_greedy


@pytest.fixture
def engine(checkpoint, tiny_model_dirs):
    return checkpoint.LLMEngine(
        str(tiny_model_dirs["gqa"]),
        max_num_seqs=4,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=64,
        **whole_prompts(checkpoint),
    )


def drain(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_requests_arriving_online_match_transformers(checkpoint, engine, tiny_hf_models):
    prompts = {"a": [5, 6, 7], "b": list(range(20, 40)), "c": [9], "d": list(range(50, 61)), "e": [3, 4]}
    greedy = checkpoint.SamplingParams(temperature=0, max_tokens=12)
    finished = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy)  # one new request every step
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    finished.update(drain(engine))
    for request_id, prompt in prompts.items():
        assert finished[request_id].token_ids == hf_greedy(tiny_hf_models["gqa"], prompt, 12)
        assert finished[request_id].prompt_token_ids == prompt


def test_each_request_keeps_its_sampling_params(checkpoint, engine, tiny_model_dirs):
    engine.add_request("greedy", [5, 6, 7], checkpoint.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], checkpoint.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request(
        "seeded", [5, 6, 7], checkpoint.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11)
    )
    finished = drain(engine)
    assert len(finished["short"].token_ids) == 2
    assert finished["short"].token_ids == finished["greedy"].token_ids[:2]
    alone = checkpoint.LLM(str(tiny_model_dirs["gqa"])).generate(
        [[5, 6, 7]], checkpoint.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11), use_tqdm=False
    )[0]
    assert finished["seeded"].token_ids == alone.token_ids


def test_abort_frees_blocks_at_once_and_others_go_on(checkpoint, engine):
    params = checkpoint.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for request_id in ("x", "y", "z"):
        engine.add_request(request_id, list(range(10, 19)), params)
    engine.step()
    used = engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks
    assert engine.abort_request("y")
    assert engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks == used - 3  # 9 slots
    assert [s.request_id for s in engine.scheduler.running] == ["x", "z"]
    assert not engine.abort_request("y") and not engine.abort_request("never-added")
    finished = drain(engine)
    assert set(finished) == {"x", "z"} and all(len(o.token_ids) == 10 for o in finished.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], {}, "empty"),
        ("", {}, "empty"),
        (list(range(3, 300)), {}, "max_model_len=256"),
        ([3] * 65, {}, "max_num_batched_tokens=64"),
        # after a preemption it would be prefilled again with what it generated: 3 + 60 - 1 > 64
        ([3, 4, 5], {"max_tokens": 63}, "max_num_batched_tokens=64"),
        ([3, 10**6], {}, "token ids outside"),
    ],
)
def test_bad_input_is_rejected_and_the_engine_keeps_serving(checkpoint, engine, prompt, params, message):
    good = checkpoint.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("ok", [5, 6, 7], good)
    engine.step()
    free_before = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, checkpoint.SamplingParams(**params))
    assert engine.block_manager.num_free_blocks == free_before
    assert [s.request_id for s in engine.scheduler.waiting] == []
    finished = drain(engine)
    assert list(finished) == ["ok"] and len(finished["ok"].token_ids) == 5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_bad_sampling_params_and_duplicate_ids(checkpoint, engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("p", [3], checkpoint.SamplingParams(top_p=0))
    engine.add_request("same", [3], checkpoint.SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", [4], checkpoint.SamplingParams(max_tokens=1))


def test_llm_generate_rejects_a_bad_batch_without_leaving_requests_behind(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[5, 6], [7, 8], []], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks


def test_a_request_larger_than_the_pool_is_rejected(checkpoint, tiny_model_dirs):
    engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=10)
    with pytest.raises(ValueError, match="num_kv_blocks=10"):
        engine.add_request("big", [3, 4, 5], checkpoint.SamplingParams(max_tokens=39))  # 41 slots
    engine.add_request("fits", [3, 4, 5], checkpoint.SamplingParams(max_tokens=38, ignore_eos=True))  # 40
    assert len(drain(engine)["fits"].token_ids) == 38


def test_a_lone_request_may_use_the_watermark(checkpoint, tiny_model_dirs):
    """The watermark keeps room for running sequences to grow; with none running, it must not block."""
    engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=10, watermark=0.2)
    assert engine.scheduler.watermark_blocks == 2
    for request_id in ("a", "b"):
        engine.add_request(request_id, list(range(3, 40)), checkpoint.SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["a"]  # 10 blocks: b waits for a
    finished = drain(engine)
    assert set(finished) == {"a", "b"}


def test_the_llm_docstring_names_every_engine_option(checkpoint):
    documented = " ".join(checkpoint.LLM.__doc__.split())
    assert [f.name for f in dataclasses.fields(checkpoint.EngineConfig) if f.name not in documented] == []
