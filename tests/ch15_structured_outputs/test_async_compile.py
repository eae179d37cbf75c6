"""Under the async engine (the server's), a constraint is compiled in a worker thread before its request is
queued: a slow compile never stalls the requests already running, and a constraint that does not compile
is the engine's ValueError with nothing queued."""

import asyncio
import threading
import time

import pytest

from chapters import submodule

pytestmark = pytest.mark.requires("structured_outputs", "serving")

COMPILE_SECONDS = 1.0


def test_a_slow_compile_runs_beside_the_steps_not_in_them(checkpoint, tiny_model_dirs, monkeypatch):
    grammar = submodule(checkpoint, "grammar")
    original, compiled_in = grammar.GrammarCache._compile, []

    def slow_compile(self, params):
        compiled_in.append(threading.current_thread().name)
        time.sleep(COMPILE_SECONDS)  # a large schema's compile, standing still
        return original(self, params)

    monkeypatch.setattr(grammar.GrammarCache, "_compile", slow_compile)
    engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    async_engine = submodule(checkpoint, "async_engine").AsyncLLMEngine(engine)
    unconstrained = checkpoint.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    constraint = checkpoint.StructuredOutputsParams(regex="[a-z]{3}")
    constrained = checkpoint.SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint)

    async def main():
        running = await async_engine.add_request([5, 6, 7], unconstrained)
        await running.__anext__()
        tokens_before = len((await running.__anext__()).token_ids)
        started = time.perf_counter()
        stream = await async_engine.add_request([8, 9], constrained)
        waited = time.perf_counter() - started
        tokens_after = len((await running.__anext__()).token_ids)
        outputs = [output async for output in stream]
        running.abort()
        return waited, tokens_after - tokens_before, outputs[-1]

    try:
        waited, tokens_meanwhile, output = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert waited >= COMPILE_SECONDS and compiled_in and "rosellm-engine" not in compiled_in
    assert tokens_meanwhile > 20  # the running request went on decoding during the compile
    assert len(output.text) == 3 and output.finish_reason == "stop"
    assert engine.grammars.num_hits == 1  # the engine thread found it compiled


def test_a_constraint_that_does_not_compile_is_refused_before_queueing(checkpoint, tiny_model_dirs):
    engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    async_engine = submodule(checkpoint, "async_engine").AsyncLLMEngine(engine)
    params = checkpoint.SamplingParams(structured_outputs=checkpoint.StructuredOutputsParams(regex="(unclosed"))

    async def main():
        with pytest.raises(ValueError, match="regex does not compile"):
            await async_engine.add_request([5, 6], params)

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert not engine.requests and not engine.has_unfinished_requests()
