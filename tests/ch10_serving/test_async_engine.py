"""The async engine: one thread steps the engine while callers add and abort from anywhere; it sleeps when idle;
a failing step is retried once, then fails only the requests it scheduled; leaving a stream aborts its request."""

import asyncio
import contextlib
import logging
import threading
import time

import pytest

from tests.ch10_serving.conftest import module_of, wait_until, wait_until_async

pytestmark = pytest.mark.requires("serving")


@pytest.fixture
def make_engine(checkpoint, tiny_model_dirs):
    """`make_engine(**options)`: an AsyncLLMEngine over a fresh LLMEngine on the tiny model, shut down afterwards."""
    engines = []

    def make(**options):
        engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), **options)
        engines.append(module_of(checkpoint, "async_engine").AsyncLLMEngine(engine))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def greedy(checkpoint, max_tokens: int):
    return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def last(stream):
    """The last output of a stream (None if it had none)."""
    output = None
    async for snapshot in stream:
        output = snapshot
    return output


def idle(engine) -> bool:
    metrics = engine.metrics
    return metrics.requests_running == metrics.requests_waiting == metrics.blocks_used == 0


def test_concurrent_requests_equal_offline(checkpoint, make_engine, offline):
    engine = make_engine()
    prompts = [f"The quick brown fox {i}" for i in range(6)]
    params = [greedy(checkpoint, 8 + i) for i in range(6)]

    async def main():
        return await asyncio.gather(*(last(engine.generate(p, q)) for p, q in zip(prompts, params)))

    outputs = asyncio.run(main())
    expected = offline.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.text for o in outputs] == [e.text for e in expected]
    wait_until(lambda: idle(engine))


def test_bad_input_raises_the_engines_error_and_leaves_nothing(checkpoint, make_engine):
    engine = make_engine()

    async def main():
        with pytest.raises(ValueError, match="max_model_len=256"):
            await engine.add_request(list(range(3, 300)), greedy(checkpoint, 4))
        return await last(engine.generate([5, 6, 7], greedy(checkpoint, 4)))

    assert len(asyncio.run(main()).token_ids) == 4
    wait_until(lambda: idle(engine))


def test_abort_from_another_thread_during_a_step_never_raises(checkpoint, make_engine, caplog):
    """Calling `LLMEngine.abort_request` while its forward runs breaks the step; the async engine queues it."""
    engine = make_engine()
    forward, in_forward, release = engine.engine.model_runner.forward, threading.Event(), threading.Event()

    def held_forward(plan):
        in_forward.set()
        assert release.wait(10)
        return forward(plan)

    engine.engine.model_runner.forward = held_forward

    async def main():
        stream = await engine.add_request([5, 6, 7], greedy(checkpoint, 100), "victim")
        assert await asyncio.to_thread(in_forward.wait, 10)
        aborter = threading.Thread(target=engine.abort_request, args=("victim",))
        aborter.start()
        aborter.join()
        release.set()
        outputs = [output async for output in stream]  # ends quietly: aborted, not failed
        assert not outputs or not outputs[-1].finished
        return await last(engine.generate([8, 9], greedy(checkpoint, 5)))

    with caplog.at_level(logging.WARNING):
        assert len(asyncio.run(main()).token_ids) == 5
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    wait_until(lambda: idle(engine))


def test_the_idle_engine_thread_sleeps(checkpoint, make_engine):
    engine = make_engine()
    asyncio.run(last(engine.generate([5, 6, 7], greedy(checkpoint, 3))))
    wait_until(lambda: idle(engine))
    clock = time.pthread_getcpuclockid(engine.thread.ident)
    start = time.clock_gettime(clock)
    time.sleep(1.0)
    assert time.clock_gettime(clock) - start < 0.01  # CPU seconds of the engine thread over one idle second


def test_a_step_that_raises_once_is_retried(checkpoint, make_engine, offline, caplog):
    engine = make_engine()
    forward, calls = engine.engine.model_runner.forward, []

    def flaky_forward(plan):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("a passing failure")
        return forward(plan)

    engine.engine.model_runner.forward = flaky_forward
    with caplog.at_level(logging.ERROR):
        output = asyncio.run(last(engine.generate("The quick brown fox", greedy(checkpoint, 6))))
    [expected] = offline.generate(["The quick brown fox"], greedy(checkpoint, 6), use_tqdm=False)
    assert output.token_ids == expected.token_ids and output.finished
    assert any("running it once more" in record.getMessage() for record in caplog.records)
    wait_until(lambda: idle(engine))


def test_a_step_that_keeps_raising_fails_only_its_requests(checkpoint, make_engine, offline):
    engine = make_engine(max_num_seqs=1)  # the poisoned request runs alone; the other waits its turn
    forward = engine.engine.model_runner.forward
    step_failed = module_of(checkpoint, "async_engine").StepFailedError

    def poisoned_forward(inputs):
        if any(seq.request_id == "poison" for seq in engine.engine.scheduler.running):  # one at a time: this step's
            raise RuntimeError("this request breaks every step")
        return forward(inputs)

    engine.engine.model_runner.forward = poisoned_forward

    async def main():
        poison = await engine.add_request([5, 6, 7], greedy(checkpoint, 6), "poison")
        good = asyncio.ensure_future(last(engine.generate("The quick brown fox", greedy(checkpoint, 6))))
        with pytest.raises(step_failed, match="failed twice"):
            await last(poison)
        return await good

    output = asyncio.run(main())
    [expected] = offline.generate(["The quick brown fox"], greedy(checkpoint, 6), use_tqdm=False)
    assert output.token_ids == expected.token_ids
    assert engine.is_running
    wait_until(lambda: idle(engine))


@pytest.mark.parametrize("how", ["break", "cancel", "exception"])
def test_leaving_the_stream_early_aborts_the_request(checkpoint, make_engine, how):
    """Steps slowed to 10 ms: the 200 tokens asked for would take 2 s; the request ends within one second."""
    engine = make_engine()
    forward = engine.engine.model_runner.forward
    engine.engine.model_runner.forward = lambda plan: time.sleep(0.01) or forward(plan)

    async def consume():
        async for output in engine.generate([5, 6, 7], greedy(checkpoint, 200)):
            if len(output.token_ids) >= 2:
                if how == "break":
                    break
                if how == "exception":
                    raise KeyError("the consumer fails")
                await asyncio.sleep(10)  # cancelled while it waits

    async def main():
        task = asyncio.ensure_future(consume())
        if how == "cancel":
            await wait_until_async(lambda: engine.metrics.blocks_used > 0)
            await asyncio.sleep(0.05)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, KeyError):
            await task
        await wait_until_async(lambda: idle(engine), timeout=1)

    asyncio.run(main())
    assert engine.metrics.blocks_free == engine.engine.block_manager.num_total_blocks


def test_shutdown_ends_what_is_in_flight_and_refuses_new_requests(checkpoint, make_engine):
    engine = make_engine()
    stopped = module_of(checkpoint, "async_engine").EngineStoppedError

    async def main():
        stream = await engine.add_request([5, 6, 7], greedy(checkpoint, 200))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(stopped):
            await last(stream)
        with pytest.raises(stopped):
            await engine.add_request([5, 6, 7], greedy(checkpoint, 2))

    asyncio.run(main())
    assert not engine.is_running and not engine.thread.is_alive()
    assert idle(engine)
