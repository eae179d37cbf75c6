"""The engine core: an `LLMEngine` alone in a process, doing nothing but schedule, run the model and sample.

Its loop: take every message waiting on its input socket (add, abort, shutdown), then run one step and send
what each request gained; with nothing to run, sleep on the socket. The engine never detokenizes here
(`detokenize=False`): text and stop strings are the front end's (async_llm.py), so no interpreter time of
this process goes to anything but the step.

Adding a request answers at once with `RequestAccepted`: queued, or the engine's ValueError. A request with
a structured-output constraint is compiled first in a worker thread (xgrammar releases the interpreter
lock), so that a large schema does not stall the requests running meanwhile.

A step that raises has been rolled back (a step is a transaction). It is run once more; if it raises again,
its requests are aborted and reported as failed, and the core goes on serving everyone else (chapter 10's
rule, async_engine.step_or_abort).

The process never outlives its front end: a thread waits on the parent's sentinel and ends the process the
moment the parent is gone, however it went (a crash, SIGKILL). Ctrl-C in a terminal reaches every process of
the group: the core ignores it and lets the front end decide when to stop it.
"""

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import zmq

from ..outputs import RequestOutput
from .async_llm_engine import step_or_abort
from .core_protocol import (
    AbortRequests,
    AddRequest,
    CoreReady,
    CoreStartFailed,
    RequestAccepted,
    RequestTokens,
    SampleTokens,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from .llm_engine import LLMEngine


class EngineCore:
    """Drives one engine from messages on `inputs` (a PULL socket), answering on `outputs` (a PUSH socket)."""

    def __init__(self, engine: LLMEngine, core: int, inputs: zmq.Socket, outputs: zmq.Socket):
        self.engine, self.core = engine, core
        self.inputs, self.outputs = inputs, outputs
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="rosellm-grammar")
        self.compiling: list[tuple[AddRequest, Future]] = []  # adds waiting for their constraint
        self.sent: dict[str, dict[int, int]] = {}  # per request, per answer: token ids already sent

    def run(self) -> None:
        """Serve messages and steps until `Shutdown`."""
        while True:
            busy = self.engine.has_unfinished_requests()
            timeout = 0 if busy else 5 if self.compiling else None  # ms; None: sleep until a message comes
            messages = self._receive(timeout)
            if any(isinstance(message, Shutdown) for message in messages):
                return
            changed = bool(messages)
            for message in messages:
                self._apply(message)
            changed |= self._add_compiled()
            if self.engine.has_unfinished_requests():
                self._step()
            elif changed:  # aborts freed blocks: the front end's view of the load must follow
                self._send(StepOutputs(self.core, [], {}, self.engine.stats()))

    def _receive(self, timeout: int | None) -> list:
        """Every message waiting; waits up to `timeout` ms (None: forever) for the first."""
        if not self.inputs.poll(timeout):
            return []
        messages = []
        while True:
            try:
                messages.append(decode(self.inputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def _apply(self, message) -> None:
        if isinstance(message, AddRequest):
            if message.params.structured_outputs is None:
                self._add(message)
            else:
                constraint = message.params.structured_outputs
                self.compiling.append((message, self.engine.grammars.compile_off_thread(constraint, self.compiler)))
        elif isinstance(message, AbortRequests):
            aborted = set(message.request_ids)
            self.compiling = [(add, job) for add, job in self.compiling if add.request_id not in aborted]
            for request_id in aborted:
                self.engine.abort_request(request_id)
                self.sent.pop(request_id, None)

    def _add_compiled(self) -> bool:
        """Add the requests whose constraint has compiled (or failed to: the add reports it)."""
        done = [(add, job) for add, job in self.compiling if job.done()]
        self.compiling = [(add, job) for add, job in self.compiling if not job.done()]
        for add, job in done:
            if job.exception() is None:
                self._add(add)
            else:
                self._send(RequestAccepted(self.core, add.request_id, str(job.exception())))
        return bool(done)

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params)
        except ValueError as error:
            self._send(RequestAccepted(self.core, message.request_id, str(error)))
            return
        self.sent[message.request_id] = {}
        self._send(RequestAccepted(self.core, message.request_id))

    def _step(self) -> None:
        start = time.perf_counter()
        outputs, failed = step_or_abort(self.engine, self.sent)
        seconds = time.perf_counter() - start
        failures = {} if failed is None else dict.fromkeys(failed.request_ids, failed.message)
        for request_id in failures:
            self.sent.pop(request_id, None)
        tokens = [self._new_tokens(output) for output in outputs]
        self._send(StepOutputs(self.core, tokens, failures, self.engine.stats(), seconds))

    def _new_tokens(self, output: RequestOutput) -> RequestTokens:
        """The part of a cumulative output the front end has not seen."""
        sent = self.sent[output.request_id]
        samples = []
        for completion in output.outputs:
            start = sent.get(completion.index, 0)
            sent[completion.index] = len(completion.token_ids)
            samples.append(SampleTokens(completion.index, completion.token_ids[start:], completion.finish_reason))
        if output.finished:
            del self.sent[output.request_id]
        return RequestTokens(output.request_id, samples, output.num_cached_tokens, output.spec_decode)

    def _send(self, message) -> None:
        self.outputs.send(encode(message), copy=False)

    def close(self) -> None:
        self.compiler.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


def run_engine_core(
    core: int, input_address: str, output_address: str, threads: int, model, device: str, dtype, options: dict
) -> None:
    """The core process' main: build the engine, say `CoreReady` (or `CoreStartFailed`), serve until
    `Shutdown`. `options` are `LLMEngine`'s engine options."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when the core stops
    threading.Thread(target=exit_with_parent, name="rosellm-parent-watch", daemon=True).start()
    torch.set_num_threads(threads)
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    try:
        engine = LLMEngine(model, device, dtype, **options, detokenize=False)
    except Exception as error:
        outputs.send(encode(CoreStartFailed(core, type(error).__name__, str(error))))
        outputs.close(linger=1000)  # let the message leave before the process ends
        raise SystemExit(1) from None
    stats = engine.stats()
    ready = CoreReady(
        core,
        os.getpid(),
        engine.max_model_len,
        engine.vocab_size,
        engine.config.block_size,
        stats.num_total_blocks,
        engine.config.enable_prefix_caching,
        stats,
    )
    outputs.send(encode(ready))
    engine_core = EngineCore(engine, core, inputs, outputs)
    try:
        engine_core.run()
    finally:
        engine_core.close()
        inputs.close(linger=0)
        outputs.close(linger=0)
        context.term()


def exit_with_parent() -> None:
    """End this process as soon as the process that started it is gone."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)
