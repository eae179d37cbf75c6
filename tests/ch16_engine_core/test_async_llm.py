"""`AsyncLLM`, the front end of engine cores in processes of their own, here with two cores (data parallelism):
the same answers as the offline `LLM`, token for token and text for text (greedy, seeded samples, n = 2, stop
strings, token-id prompts, a structured-output constraint compiled in the core); bad input raises the engine's
own ValueError and queues nothing; an aborted stream frees its blocks in its core; shutdown ends what is in
flight and leaves no process."""

import asyncio
import os
from pathlib import Path

import pytest

from tests.ch10_serving.conftest import module_of, wait_until, wait_until_async

# Each test starts engine-core processes. Later chapters carry the front end and the core unchanged (chapter 17
# moved them into engine/): `make test` runs these on the latest checkpoint alone, `make test-all` on each.
pytestmark = [pytest.mark.requires("engine_core"), pytest.mark.latest_only]


async def last(stream):
    output = None
    async for snapshot in stream:
        output = snapshot
    return output


def idle(engine) -> bool:
    metrics = engine.metrics
    return metrics.requests_running == metrics.requests_waiting == metrics.blocks_used == 0


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie), from /proc."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def requests(checkpoint) -> list[tuple]:
    """(prompt, params): greedy, seeded samples, two answers, a stop string, token ids, a shared prefix."""
    params = checkpoint.SamplingParams
    shared = "A long shared system prompt for the prefix cache to find again and again. "
    return [
        ("The quick brown fox", params(temperature=0, max_tokens=12)),
        ("Paris is the capital of", params(temperature=0.9, top_p=0.9, seed=7, max_tokens=10)),
        ("Once upon a time", params(temperature=0.8, seed=3, n=2, max_tokens=9)),
        ("Once upon a time", params(temperature=0, max_tokens=20, stop=["e", "o"], ignore_eos=True)),
        (list(range(10, 40)), params(temperature=0, max_tokens=8)),
        *((shared + f"Question {i}", params(temperature=0, max_tokens=6 + i)) for i in range(5)),
    ]


def test_answers_equal_offline_on_both_cores(checkpoint, dp_server, offline):
    engine = dp_server.async_engine
    prompts, params = zip(*requests(checkpoint))

    async def main():
        return await asyncio.gather(*(last(engine.generate(p, q)) for p, q in zip(prompts, params)))

    outputs = asyncio.run(main())
    expected = offline.generate(list(prompts), list(params), use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert [(c.token_ids, c.text, c.finish_reason) for c in output.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in want.outputs
        ]
        assert output.prompt_token_ids == want.prompt_token_ids and output.prompt == want.prompt
    assert expected[3].finish_reason == "stop" and len(expected[3].token_ids) < 20  # the stop string did stop it
    wait_until(lambda: idle(engine))
    queried = [engine.metrics.stats[core].prefix_cache_queries for core in (0, 1)]
    assert all(queried), f"prompt tokens per core: {queried}"  # both cores served requests
    assert engine.router.loads == [0, 0]


def test_a_constraint_compiles_in_the_core_and_binds_the_answer(checkpoint, dp_server, offline):
    engine = dp_server.async_engine
    constraint = checkpoint.StructuredOutputsParams(choice=["red", "green", "blue"])
    params = checkpoint.SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint)
    output = asyncio.run(last(engine.generate("My favourite colour is", params)))
    [want] = offline.generate(["My favourite colour is"], params, use_tqdm=False)
    assert output.text in ("red", "green", "blue") and output.token_ids == want.token_ids
    bad = checkpoint.SamplingParams(structured_outputs=checkpoint.StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="does not compile"):
        asyncio.run(engine.add_request("hi", bad))
    wait_until(lambda: idle(engine))


def test_bad_input_raises_the_engine_s_error_and_queues_nothing(checkpoint, dp_server, offline):
    engine = dp_server.async_engine
    long_prompt = list(range(5, 5 + offline.llm_engine.max_model_len))
    cases = [
        (long_prompt, checkpoint.SamplingParams(max_tokens=4)),
        ([5, 10**6], None),
        ("", None),
        ("hi", checkpoint.SamplingParams(max_tokens=4, stop_token_ids=[-1 + 10**7])),
    ]
    for prompt, params in cases:
        with pytest.raises(ValueError) as offline_error:
            offline.llm_engine.add_request("bad", prompt, params)
        with pytest.raises(ValueError) as split_error:
            asyncio.run(engine.add_request(prompt, params, request_id="bad"))
        assert str(split_error.value) == str(offline_error.value)
    with pytest.raises(ValueError, match="must be SamplingParams"):
        asyncio.run(engine.add_request("hi", {"max_tokens": 3}))

    async def twice():
        stream = await engine.add_request("hi", checkpoint.SamplingParams(max_tokens=200, ignore_eos=True), "same")
        try:
            with pytest.raises(ValueError, match="already in use"):
                await engine.add_request("hi", None, "same")
        finally:
            stream.abort()

    asyncio.run(twice())
    wait_until(lambda: idle(engine))
    assert engine.router.loads == [0, 0] and not engine._requests


def test_an_aborted_stream_frees_its_blocks_in_its_core(checkpoint, dp_server):
    engine = dp_server.async_engine

    async def main():
        streams = [
            await engine.add_request(f"Request {i}", checkpoint.SamplingParams(max_tokens=240, ignore_eos=True))
            for i in range(4)
        ]
        for stream in streams:
            await anext(stream)
        for stream in streams:
            stream.abort()
        await wait_until_async(lambda: idle(engine), timeout=1)
        ends = [await last(stream) for stream in streams]  # aborted streams simply end, unfinished
        assert all(output is None or not output.finished for output in ends)

    asyncio.run(main())
    assert engine.metrics.blocks_free == dp_server.num_total_blocks


def test_shutdown_ends_what_is_in_flight_and_leaves_no_process(checkpoint, tiny_model_dirs):
    engine = checkpoint.AsyncLLM(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    stopped = module_of(checkpoint, "async_engine").EngineStoppedError
    [pid] = [ready.pid for ready in engine.client.ready]
    assert pid != os.getpid() and alive(pid)

    async def main():
        stream = await engine.add_request([5, 6, 7], checkpoint.SamplingParams(max_tokens=240, ignore_eos=True))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(stopped):
            await last(stream)
        with pytest.raises(stopped):
            await engine.add_request([5, 6, 7])

    asyncio.run(main())
    engine.shutdown()  # again: nothing happens
    assert not engine.is_running and not alive(pid)


def test_a_bad_option_fails_before_any_process_starts(checkpoint, tiny_model_dirs):
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        checkpoint.AsyncLLM(str(tiny_model_dirs["gqa"]), max_num_seqs=0)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        checkpoint.AsyncLLM(str(tiny_model_dirs["gqa"]), data_parallel_size=0)
    with pytest.raises(ValueError, match="max_model_len must be in"):  # raised in the core, raised again here
        checkpoint.AsyncLLM(str(tiny_model_dirs["gqa"]), max_model_len=10**6, enforce_eager=True)


def test_both_engines_time_their_steps_where_they_run(checkpoint, tiny_model_dirs, dp_server):
    """The step-duration histogram: the split engine's steps are timed in the cores; chapter 10's in its thread."""
    in_process = module_of(checkpoint, "async_engine").AsyncLLMEngine(
        checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    )
    try:
        for engine in (in_process, dp_server.async_engine):
            steps = engine.metrics.step_duration
            before = sum(steps.counts)
            asyncio.run(last(engine.generate("hi", checkpoint.SamplingParams(max_tokens=5, ignore_eos=True))))
            wait_until(lambda steps=steps, before=before: sum(steps.counts) >= before + 5)
    finally:
        in_process.shutdown()


def test_a_stop_string_found_here_stops_the_request_in_its_core(checkpoint, dp_server):
    """The front end finds the stop string a step or so after the core sampled its last token, keeps the tokens
    up to it, and aborts the request in the core. The core does not wait for the front end: it runs ahead by as
    many steps as the outputs take to reach it (two or three on an idle machine, more on a busy one), far fewer
    than the 240 a request left running would take."""
    engine = dp_server.async_engine
    params = dict(temperature=0, max_tokens=30, ignore_eos=True)
    free = asyncio.run(last(engine.generate("The quick brown fox", checkpoint.SamplingParams(**params))))
    wait_until(lambda: idle(engine))
    stop = free.text[6:9]
    steps, before = engine.metrics.step_duration, sum(engine.metrics.step_duration.counts)
    long = checkpoint.SamplingParams(**params | {"max_tokens": 240, "stop": [stop]})
    stopped = asyncio.run(last(engine.generate("The quick brown fox", long)))
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    wait_until(lambda: idle(engine))
    assert sum(steps.counts) - before <= len(stopped.token_ids) + 30
