"""The front end of a split server (vLLM's `AsyncLLM`): everything around the engine, in the server's process,
while the engine runs in engine-core processes of its own (core.py).

In chapter 10's `AsyncLLMEngine`, the HTTP server, tokenization, detokenization, stop strings and the engine
share one interpreter, so the engine's step waits whenever the server holds the interpreter lock. Here the
front end keeps the work on text: it tokenizes a prompt, sends the token ids to a core, and turns the token
ids each step sends back into text, matching stop strings, before it hands each request's `RequestOutput`
to the stream its caller reads. The cores do nothing but schedule, run the model and sample.

It has `AsyncLLMEngine`'s interface (`add_request`, `generate`, `abort_request`, `shutdown`, `is_running`,
`metrics`, `tokenizer`, `max_model_len`) and its guarantees: bad input raises the engine's ValueError and
queues nothing; leaving a stream and aborting it frees its blocks in its core; a step that fails twice ends
its requests with `StepFailedError`. And one of its own: a core that dies ends every request in flight with
`EngineDeadError` within a second (before the other cores are stopped, which may take seconds), and the
front end refuses new ones from then on. Nothing here waits for a core: messages to the cores are queued
under the lock and sent after it, without blocking (core_client.py), so a dead core or one that falls behind
never freezes the caller's event loop.

A stop string is found here, a step or two after the core sampled the token that completed it: the front end
keeps the tokens up to that one (the answer is exactly the in-process one) and aborts the request in its core.
With n > 1, an answer stopped by a stop string while its siblings go on keeps running in the core until the
request ends (its extra tokens are dropped here): a core knows requests, not answers.

With `data_parallel_size` N, N cores each hold a full copy of the model and a KV pool of their own, and each
new request goes to one of them (replica_router.py).
"""

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator

from ..config.engine import EngineConfig
from ..metrics.prometheus import EngineMetrics
from ..model_executor.model_loader.loader import load_tokenizer, tokenizer_folder
from ..outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from ..sampling_params import SamplingParams
from .async_llm_engine import EngineStoppedError, RequestStream, StepFailedError, deliver, settle
from .core_client import CoreClient
from .core_protocol import AbortRequests, AddRequest, RequestAccepted, RequestTokens, StepOutputs
from .detokenizer import IncrementalDetokenizer
from .input_processor import check_request_id_free, copy_sampling_params, tokenize_prompt
from .output_processor import released_text
from .replica_router import ReplicaRouter
from .stop_strings import StopStringMatcher


class EngineDeadError(EngineStoppedError):
    """An engine core process ended without being asked to: the engine stopped with it."""


@dataclasses.dataclass
class Answer:
    """One of a request's answers, as the front end builds it: its tokens, and the text they make."""

    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ended_in_core: bool = False  # the core finished it too (a stop string ends it here first)

    def add(self, new_token_ids: list[int], finish_reason: str | None) -> None:
        """The tokens a step gave this answer, and why the core ended it there if it did (`finish_reason`)."""
        self.ended_in_core = finish_reason is not None
        for position, token in enumerate(new_token_ids):
            if self.finish_reason is not None:
                return  # past a stop string: the core's extra tokens are dropped
            final = finish_reason if position == len(new_token_ids) - 1 else None
            self.token_ids.append(token)
            self.text += released_text(self.detokenizer, self.stop_matcher, token, final is not None)
            self.finish_reason = "stop" if self.stop_matcher.stopped else final


@dataclasses.dataclass
class FrontendRequest:
    """One request in flight: its stream, its prompt, its answers so far, and the core that runs it."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core: int
    accepted: asyncio.Future
    answers: dict[int, Answer] = dataclasses.field(default_factory=dict)
    num_cached_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None

    @property
    def ended_in_core(self) -> bool:
        return len(self.answers) == self.params.n and all(answer.ended_in_core for answer in self.answers.values())

    def update(self, tokens: RequestTokens, tokenizer) -> RequestOutput:
        """Take what a step gave the request; returns its new snapshot."""
        self.num_cached_tokens, self.spec_decode = tokens.num_cached_tokens, tokens.spec_decode
        for sample in tokens.samples:
            if sample.index not in self.answers:
                detokenizer, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher(self.params.stop)
                self.answers[sample.index] = Answer(detokenizer, matcher)
            self.answers[sample.index].add(sample.new_token_ids, sample.finish_reason)
        completions = [
            CompletionOutput(index, list(answer.token_ids), answer.text, answer.finish_reason)
            for index, answer in sorted(self.answers.items())
        ]
        return RequestOutput(
            self.stream.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            completions,
            self.num_cached_tokens,
            self.spec_decode,
        )


class AsyncLLM:
    """A split engine: this front end, and `data_parallel_size` engine-core processes on `model` (module
    docstring). `device`, `dtype` and `engine_options` are `LLMEngine`'s. Every method is safe from any
    thread or event loop; `shutdown()` stops the cores (it also runs at exit)."""

    def __init__(self, model=None, device: str = "cpu", dtype=None, data_parallel_size: int = 1, **engine_options):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        config = EngineConfig(**engine_options)  # a bad option fails here, before any process starts
        self.tokenizer = load_tokenizer(tokenizer_folder(model, config.quantization))  # converts a GGUF file once
        self.client = CoreClient(model, device, dtype, engine_options, data_parallel_size)
        first = self.client.ready[0]
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size
        self.router = ReplicaRouter(
            data_parallel_size, first.block_size, first.num_total_blocks, first.enable_prefix_caching
        )
        self.metrics = EngineMetrics()
        for ready in self.client.ready:
            self.metrics.record_stats(ready.stats, engine=ready.core)
        self._lock = threading.Lock()  # guards the fields below
        self._requests: dict[str, FrontendRequest] = {}
        self._error: EngineStoppedError | None = None  # set once: shut down, or a core died
        self.client.start(self._on_message, self._on_death)

    @property
    def data_parallel_size(self) -> int:
        return len(self.client.processes)

    @property
    def is_running(self) -> bool:
        return self._error is None

    # --- callers (any thread) -------------------------------------------------------------------------

    async def add_request(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Tokenize, send to a core, wait until the core has checked the request: at most one step. Raises the
        engine's ValueError for bad input, EngineStoppedError (EngineDeadError) once stopped. The caller owns
        the returned stream: it must `abort()` it if it stops listening."""
        params = copy_sampling_params(sampling_params)
        text, token_ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        loop = asyncio.get_running_loop()
        stream = RequestStream(uuid.uuid4().hex if request_id is None else str(request_id), loop, self._abort)
        with self._lock:
            if self._error is not None:
                raise self._error
            check_request_id_free(stream.request_id, self._requests)
            core = self.router.route(token_ids)
            request = FrontendRequest(stream, text, token_ids, params, core, loop.create_future())
            self._requests[stream.request_id] = request
            self.client.post(core, AddRequest(stream.request_id, token_ids, params))
        self.client.flush()
        try:
            await request.accepted
        except asyncio.CancelledError:
            stream.abort()  # sent behind the add: the request leaves as soon as it came
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
        """Abort a request, waiting or running, in its core. Unknown or finished: nothing happens."""
        self._end(str(request_id), abort=True)

    def shutdown(self) -> None:
        """Stop the cores. Requests in flight end with EngineStoppedError. Calling it again does nothing."""
        self._stop(EngineStoppedError("the engine was shut down"))

    def _abort(self, stream: RequestStream) -> None:
        self._end(stream.request_id, abort=True, owner=stream)

    # --- the receiver thread ----------------------------------------------------------------------------

    def _on_message(self, message) -> None:
        if isinstance(message, RequestAccepted):
            with self._lock:
                request = self._requests.get(message.request_id)
            if request is not None and message.error is not None:  # refused: nothing to abort
                self._end(message.request_id, owner=request.stream, deliver_end=False)
            if request is not None:
                error = None if message.error is None else ValueError(message.error)
                deliver(request.stream.loop, settle, request.accepted, error)
        elif isinstance(message, StepOutputs):
            self._on_outputs(message)

    def _on_outputs(self, message: StepOutputs) -> None:
        now = time.perf_counter()
        for tokens in message.outputs:
            with self._lock:
                request = self._requests.get(tokens.request_id)
            if request is None:  # aborted meanwhile
                continue
            output = request.update(tokens, self.tokenizer)
            stream = request.stream
            if stream.last_output_time is None:
                self.metrics.record_first_output(now - stream.arrival)
            else:
                self.metrics.record_next_output(now - stream.last_output_time)
            stream.last_output_time = now
            if output.finished:  # by the core, or here by a stop string (then the core must stop it too)
                self._end(tokens.request_id, abort=not request.ended_in_core, deliver_end=False)
            if not deliver(stream.loop, stream.put, output):  # its event loop is gone: nobody listens
                self._end(tokens.request_id, abort=True)
        for request_id, error in message.failed.items():
            self._end(request_id, error=StepFailedError(error))  # the core aborted it
        self.metrics.record_stats(message.stats, engine=message.core)
        if message.step_seconds is not None:
            self.metrics.record_step(message.step_seconds)

    def _on_death(self, core: int, exitcode: int | None) -> None:
        self._stop(EngineDeadError(f"engine core {core} died (exit code {exitcode}); the engine stopped"))

    # --- both -------------------------------------------------------------------------------------------

    def _end(
        self,
        request_id: str,
        abort: bool = False,
        owner: RequestStream | None = None,
        error: BaseException | None = None,
        deliver_end: bool = True,
    ) -> None:
        """Forget a request (if `owner` is given, only if it is still that stream's), abort it in its core
        (`abort`), and end its stream with `error` (`deliver_end`)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or (owner is not None and request.stream is not owner):
                return
            del self._requests[request_id]
            self.router.release(request.core)
            if abort and self._error is None:
                self.client.post(request.core, AbortRequests([request_id]))
        self.client.flush()
        if deliver_end:
            deliver(request.stream.loop, request.stream.end, error)

    def _stop(self, error: EngineStoppedError) -> None:
        """Refuse new requests, end every request in flight with `error`, then stop the cores (which may wait
        seconds for a core that does not answer)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            requests, self._requests = list(self._requests.values()), {}
        for request in requests:
            deliver(request.stream.loop, settle, request.accepted, error)
            deliver(request.stream.loop, request.stream.end, error)
        self.client.shutdown()
