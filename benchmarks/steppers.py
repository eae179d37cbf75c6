"""One step at a time through a checkpoint's public API, the same way for every chapter that steps: chapters
03-05 (`LLM.add_request`, `llm.scheduler.step()`) and 07 on (`LLMEngine.add_request`, `step()`). A step returns
(key, token ids so far, finished) for each request that got a token."""


class OfflineStepper:
    """A chapter 03-05 `LLM` and its offline scheduler."""

    def __init__(self, module, llm):
        self.module, self.llm, self.sessions = module, llm, {}

    def add(self, key: str, prompt: list[int], max_tokens: int) -> None:
        params = self.module.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.sessions[key] = self.llm.add_request(prompt, params)

    def step(self) -> list[tuple[str, list[int], bool]]:
        keys = {id(session): key for key, session in self.sessions.items()}
        return [
            (keys[id(session)], list(session.output.token_ids), session.finished)
            for session, _ in self.llm.scheduler.step()
        ]

    def busy(self) -> bool:
        return self.llm.scheduler.has_unfinished_requests()


class EngineStepper:
    """A chapter 07+ `LLMEngine`; also tells which requests a step preempted (running before, waiting after)."""

    def __init__(self, module, engine):
        self.module, self.engine, self.preempted = module, engine, []

    def add(self, key: str, prompt: list[int], max_tokens: int) -> None:
        params = self.module.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(key, prompt, params)

    def step(self) -> list[tuple[str, list[int], bool]]:
        running = {seq.request_id for seq in self.engine.scheduler.running}
        outputs = self.engine.step()
        self.preempted = sorted(running & {seq.request_id for seq in self.engine.scheduler.waiting})
        return [(o.request_id, list(o.token_ids), o.finished) for o in outputs]

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()
