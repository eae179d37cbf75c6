"""The engine core's loop, in this process over `inproc://` sockets: an add is answered at once; the token ids
of its steps add up to the offline engine's; a step that fails twice aborts its requests, reports them as
failed, frees their blocks, and the core serves the next request; `Shutdown` ends the loop."""

import threading

import pytest
import zmq

from chapters import submodule
from tests.ch16_engine_core.conftest import idle

pytestmark = pytest.mark.requires("engine_core")


class CoreInThread:
    """An `EngineCore` on a fresh engine, run by a thread; `send` and `receive` speak to it as a front end."""

    def __init__(self, checkpoint, model_dir):
        protocol = submodule(checkpoint, "core_protocol")
        engine_core = submodule(checkpoint, "engine_core")
        self.protocol, self.context = protocol, zmq.Context()
        self.to_core, self.from_core = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
        self.to_core.bind("inproc://inputs")
        self.from_core.bind("inproc://outputs")
        inputs, outputs = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
        inputs.connect("inproc://inputs")
        outputs.connect("inproc://outputs")
        self.engine = checkpoint.LLMEngine(str(model_dir), enforce_eager=True, detokenize=False)
        self.core = engine_core.EngineCore(self.engine, 0, inputs, outputs)
        self.thread = threading.Thread(target=self.core.run, daemon=True)
        self.thread.start()

    def send(self, message) -> None:
        self.to_core.send(self.protocol.encode(message))

    def receive(self):
        assert self.from_core.poll(10_000), "the core said nothing for 10 s"
        return self.protocol.decode(self.from_core.recv())

    def run_to_end(self, request_id: str) -> tuple[list[int], str | None, object]:
        """Messages until the request finishes or fails: (its token ids, its failure, the last StepOutputs)."""
        tokens = []
        while True:
            message = self.receive()
            if not isinstance(message, self.protocol.StepOutputs):
                continue
            if request_id in message.failed:
                return tokens, message.failed[request_id], message
            for output in message.outputs:
                [sample] = output.samples
                tokens += sample.new_token_ids
                if sample.finish_reason is not None:
                    return tokens, None, message

    def stop(self) -> None:
        self.send(self.protocol.Shutdown())
        self.thread.join(timeout=10)
        self.core.close()
        self.context.destroy(linger=0)


def test_a_core_answers_steps_fails_and_stops(checkpoint, checkpoint_info, tiny_model_dirs, monkeypatch):
    core = CoreInThread(checkpoint, tiny_model_dirs["gqa"])
    p = core.protocol
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    offline.add_request("want", [5, 6, 7, 8], params)
    while offline.has_unfinished_requests():
        [want] = offline.step()
    try:
        core.send(p.AddRequest("bad", list(range(10**6, 10**6 + 3)), params))
        refused = core.receive()
        assert isinstance(refused, p.RequestAccepted) and "outside the vocabulary" in refused.error

        def broken(inputs):
            raise RuntimeError("a broken forward")

        monkeypatch.setattr(core.engine.model_runner, "forward", broken)
        core.send(p.AddRequest("doomed", [5, 6, 7, 8], params))
        tokens, failure, last = core.run_to_end("doomed")
        assert tokens == [] and "a broken forward" in failure
        assert idle(last.stats, checkpoint_info)
        monkeypatch.undo()

        core.send(p.AddRequest("fine", [5, 6, 7, 8], params))
        accepted = core.receive()
        assert isinstance(accepted, p.RequestAccepted) and accepted.error is None
        tokens, failure, last = core.run_to_end("fine")
        assert failure is None and tokens == want.token_ids
        assert last.step_seconds > 0 and not core.core.sent  # nothing kept for a finished request
    finally:
        core.stop()
    assert not core.thread.is_alive()
