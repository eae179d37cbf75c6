"""Running a list of timed requests through an `LLMEngine`, recording every plan: shared by chapter 09's tests."""

from dataclasses import dataclass, field


@dataclass
class Run:
    """What one run produced: every request's answers (token ids per sample), its cached prompt tokens,
    and every step's plan."""

    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    plans: list = field(default_factory=list)

    @property
    def num_preemptions(self) -> int:
        return sum(len(plan.preempted) for plan in self.plans)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the forwards ran, all steps together."""
        return sum(sum(plan.num_new_tokens) for plan in self.plans)

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [copy for plan in self.plans for copy in plan.copies]


def run(engine, requests, params, max_steps: int = 5000) -> Run:
    """`requests`: (arrival step, prompt token ids, max_tokens); `params(index, max_tokens)` gives each one's
    SamplingParams. Runs until everything finished; checks that every block is free at the end."""
    result, schedule = Run(), engine.scheduler.schedule

    def recording_schedule(*drafts):  # from chapter 14, the drafts of speculative decoding
        result.plans.append(schedule(*drafts))
        return result.plans[-1]

    engine.scheduler.schedule = recording_schedule
    step = 0
    while step < max(arrival for arrival, _, _ in requests) or engine.has_unfinished_requests():
        step += 1
        for index, (arrival, prompt, max_tokens) in enumerate(requests):
            if arrival == step:
                engine.add_request(str(index), prompt, params(index, max_tokens))
        for output in engine.step():
            if output.finished:
                result.tokens[output.request_id] = [list(o.token_ids) for o in output.outputs]
                result.num_cached_tokens[output.request_id] = output.num_cached_tokens
        assert step < max_steps
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    return result
