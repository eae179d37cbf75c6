"""The async engine: one `LLMEngine` driven by a background thread while requests arrive and leave.

The step-level engine is a plain object: it expects one caller at a time. A server has many callers at once,
and an abort arriving from another thread in the middle of a forward would change the bookkeeping under the
step's feet. So here exactly one thread, the engine thread, ever touches the `LLMEngine`:

- callers, from any thread or event loop, queue operations ("add this request", "abort that one") under one
  lock; the engine thread applies them between steps, in the order they came;
- after each step, it hands every request's new output to the event loop its caller waits on
  (`loop.call_soon_threadsafe`); outputs are cumulative snapshots, so a consumer that falls behind gets the
  latest one and misses no text;
- with nothing queued and nothing to run, it sleeps on the lock's condition variable: no polling.

PyTorch releases the GIL inside its kernels, so the event loop keeps answering clients while a forward runs.

One thing is done before a request is queued, in a worker thread: compiling its structured-output constraint
into the engine's grammar cache (thread-safe; xgrammar releases the GIL). A large schema takes seconds to
compile; done on the engine thread it would stall every running request for as long. The engine thread then
finds the grammar in the cache.

Failures: a step that raises has been rolled back by the engine (a step is a transaction). It is run once more
(the failure may pass); if it raises again, the requests it scheduled end with `StepFailedError` on their
streams and are aborted, and the engine thread goes on serving everyone else. The rule is `step_or_abort`,
which chapter 16's engine core runs too.
"""

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..metrics.prometheus import EngineMetrics
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine, StepError

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine was shut down: no new request is taken, and those in flight end with this error."""


class StepFailedError(RuntimeError):
    """A step that ran this request raised twice; the request was aborted (the cause is chained)."""


class RequestStream:
    """One request's outputs, as an async iterator of `RequestOutput` snapshots, each holding everything so far.

    It ends after the finished output; it raises the error that ended the request (`StepFailedError`,
    `EngineStoppedError`); it simply ends if the request was aborted. Leaving it early does not stop the
    request: call `abort()` (or iterate through `AsyncLLMEngine.generate`, which does)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort: Callable[["RequestStream"], None]):
        self.request_id = request_id
        self.loop = loop  # where its consumer waits
        self.arrival = time.perf_counter()
        self.last_output_time: float | None = None  # the engine thread's, for the latency metrics
        self._abort = abort
        self._latest: RequestOutput | None = None  # not yet taken by the consumer
        self._error: BaseException | None = None
        self._ended = False
        self._ready = asyncio.Event()

    def abort(self) -> None:
        """Stop the request and free its blocks before the next step (nothing happens if it already ended)."""
        self._abort(self)

    # Called on `loop` only (the engine thread goes through `call_soon_threadsafe`).

    def put(self, output: RequestOutput) -> None:
        self._latest, self._ended = output, output.finished
        self._ready.set()

    def end(self, error: BaseException | None = None) -> None:
        self._error, self._ended = error, True
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                output, self._latest = self._latest, None
                return output
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()


@dataclass
class AddRequest:
    """Queue `prompt` for `stream`'s request, then settle `accepted` (with the engine's error, if refused)."""

    stream: RequestStream
    prompt: object
    params: SamplingParams | None
    accepted: asyncio.Future


@dataclass
class AbortRequest:
    """Abort a request; from a stream (`owner`), only if that stream's request is still the one in the engine
    under this id (the id may have been refused and taken again)."""

    request_id: str
    owner: RequestStream | None = None


class AsyncLLMEngine:
    """Drives one `LLMEngine` from a background thread; every method is safe from any thread or event loop.

    `await add_request(...)` returns a `RequestStream` once the engine accepted the request (bad input raises
    the engine's ValueError); `generate(...)` is the same as an async generator that aborts its request
    however it is left (break, cancellation, exception). `metrics` is what the server's /metrics shows;
    `tokenizer` and `max_model_len` are the engine's (they never change)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.metrics = EngineMetrics()
        self._compiler = ThreadPoolExecutor(thread_name_prefix="rosellm-grammar")  # constraints, off this thread
        self._lock = threading.Condition()  # guards the two fields below; the engine thread sleeps on it
        self._pending: list[AddRequest | AbortRequest] = []  # for the engine thread, in arrival order
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # requests in the engine: the engine thread's only
        self.metrics.record_stats(engine.stats())
        self.thread = threading.Thread(target=self._run, name="rosellm-engine", daemon=True)  # the engine thread
        self.thread.start()

    @property
    def is_running(self) -> bool:
        return self.thread.is_alive() and not self._stopping

    # --- callers (any thread) -------------------------------------------------------------------------

    async def add_request(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request (prompt as `LLMEngine.add_request` takes it) and wait until the engine thread has
        checked it: at most one step. Raises the engine's ValueError for bad input, EngineStoppedError after
        `shutdown()`. The caller owns the returned stream: it must `abort()` it if it stops listening."""
        loop = asyncio.get_running_loop()
        constraint = getattr(sampling_params, "structured_outputs", None)
        if constraint is not None:  # off the engine thread (module docstring); a bad one raises ValueError here
            await asyncio.wrap_future(self.engine.grammars.compile_off_thread(constraint, self._compiler))
        stream = RequestStream(uuid.uuid4().hex if request_id is None else str(request_id), loop, self._abort)
        accepted = loop.create_future()
        if not self._submit(AddRequest(stream, prompt, sampling_params, accepted)):
            raise EngineStoppedError("the engine is shut down")
        try:
            await accepted
        except asyncio.CancelledError:
            stream.abort()  # queued behind the add: the request leaves as soon as it came
            raise
        return stream

    async def generate(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving early (break, cancellation, exception) aborts it."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort_request(self, request_id: str) -> None:
        """Abort a request, waiting or running; applied before the next step. Unknown or finished: nothing."""
        self._submit(AbortRequest(str(request_id)))

    def shutdown(self) -> None:
        """Stop the engine thread after its current step. Requests still queued or in flight end with
        EngineStoppedError and are aborted (their blocks return to the pool). Calling it again does nothing."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._compiler.shutdown(wait=False, cancel_futures=True)
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _abort(self, stream: RequestStream) -> None:
        self._submit(AbortRequest(stream.request_id, stream))

    def _submit(self, operation: AddRequest | AbortRequest) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self._pending.append(operation)
            self._lock.notify()
        return True

    # --- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._pending or self._stopping or self.engine.has_unfinished_requests()):
                        self._lock.wait()
                    if self._stopping:
                        break
                    operations, self._pending = self._pending, []
                for operation in operations:
                    self._apply(operation)
                if self.engine.has_unfinished_requests():
                    self._step()
                self.metrics.record_stats(self.engine.stats())
        except Exception:
            logger.exception("the engine thread failed; the engine stops")
        finally:
            self._stop_everything()

    def _apply(self, operation: AddRequest | AbortRequest) -> None:
        """One queued operation, in the engine thread."""
        if isinstance(operation, AddRequest):
            stream = operation.stream
            try:
                self.engine.add_request(stream.request_id, operation.prompt, operation.params)
            except Exception as error:  # ValueError for bad input; anything else is the caller's to see too
                deliver(stream.loop, settle, operation.accepted, error)
                return
            self._streams[stream.request_id] = stream
            if not deliver(stream.loop, settle, operation.accepted, None):
                self._end(stream.request_id)
        elif operation.owner is None or self._streams.get(operation.request_id) is operation.owner:
            self._end(operation.request_id)

    def _step(self) -> None:
        start = time.perf_counter()
        outputs, failed = step_or_abort(self.engine, self._streams)
        if failed is not None:
            error = StepFailedError(failed.message)
            error.__cause__ = failed.cause
            for request_id in failed.request_ids:
                self._end(request_id, error)
            return
        now = time.perf_counter()
        self.metrics.record_step(now - start)
        for output in outputs:
            stream = self._streams[output.request_id]
            if stream.last_output_time is None:
                self.metrics.record_first_output(now - stream.arrival)
            else:
                self.metrics.record_next_output(now - stream.last_output_time)
            stream.last_output_time = now
            if output.finished:
                del self._streams[output.request_id]
            if not deliver(stream.loop, stream.put, output):  # its event loop is gone: nobody listens
                self._end(output.request_id)

    def _end(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request in the engine (its blocks are freed at once) and end its stream, with `error`."""
        self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            deliver(stream.loop, stream.end, error)

    def _stop_everything(self) -> None:
        """On the way out: refuse what is queued, end what is in flight."""
        with self._lock:
            self._stopping = True
            operations, self._pending = self._pending, []
        error = EngineStoppedError("the engine was shut down")
        for operation in operations:
            if isinstance(operation, AddRequest):
                deliver(operation.stream.loop, settle, operation.accepted, error)
        for request_id in list(self._streams):
            self._end(request_id, error)
        self.metrics.record_stats(self.engine.stats())


@dataclass
class FailedStep:
    """A step that raised twice: the requests it had scheduled (aborted in the engine), and why."""

    request_ids: list[str]
    cause: BaseException

    @property
    def message(self) -> str:
        return f"a step running this request failed twice: {self.cause!r}"


def step_or_abort(engine: LLMEngine, in_flight: Iterable[str]) -> tuple[list[RequestOutput], FailedStep | None]:
    """One step of `engine`, run once more if it raises (the engine rolled it back; the failure may pass).
    If it raises again: no outputs, and the requests it scheduled, aborted in the engine (every request of
    `in_flight` if it failed before it scheduled any: then no request can run)."""
    try:
        return engine.step(), None
    except Exception:
        logger.exception("a step failed (the engine rolled it back); running it once more")
    try:
        return engine.step(), None
    except Exception as error:
        logger.exception("the step failed again; aborting the requests it scheduled")
        failed = FailedStep(list(in_flight), error)
        if isinstance(error, StepError):
            failed = FailedStep(list(error.request_ids), error.__cause__)
        for request_id in failed.request_ids:
            engine.abort_request(request_id)
        return [], failed


def deliver(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> bool:
    """Run `callback(*args)` on `loop` soon, from another thread. False if that loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    """Resolve `future` (None, or raise `error`), unless its waiter gave up already."""
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
