"""Each sequence asks for as many drafts as its last verify step earned, and waits after drafts that were all
rejected (`spec_decode/draft_pace.py`).

The pace by hand; then in the engine with proposers that are always right, right once, or always wrong
(drafts made from the plain engine's own greedy answer), whose verify steps are counted exactly; greedy
tokens equal with the pace on and off under a pool that preempts; a commit that fails puts the pace back.
"""

import pytest

from chapters import submodule
from tests.ch09_prefix_caching.engine_runs import run
from tests.ch11_cpu_performance.test_fast_path import REFERENCE, REQUESTS, prompt
from tests.ch14_speculative_decoding.test_speculative_engine import NGRAM, engine, greedy

pytestmark = pytest.mark.requires("speculative_decoding")


@pytest.fixture
def pace_module(checkpoint):
    return submodule(checkpoint, "draft_pace")


def test_the_pace_by_hand(pace_module):
    """k = 4: all accepted keeps (or grows) the length, a of them makes it a + 1, none waits 1, 2, 4, ...
    tokens, at most MAX_WAIT, until a draft is accepted again."""
    Pace = pace_module.DraftPace
    pace = Pace(4)
    assert pace.ready(0)
    assert pace.after(4, 4, 10, most=4) == Pace(4)
    assert pace.after(4, 2, 10, most=4) == Pace(3)
    assert Pace(3).after(3, 3, 10, most=4) == Pace(4)
    assert Pace(3).after(2, 2, 10, most=4) == Pace(3)  # the proposer found only two: no shorter for that
    missed = pace.after(4, 0, 20, most=4)
    assert missed == Pace(1, 21, 1)
    assert not missed.ready(20) and missed.ready(21)
    waits = []
    for tokens in range(22, 200, 30):
        missed = missed.after(1, 0, tokens, most=4)
        waits.append(missed.resume_at - tokens)
    assert waits == [2, 4, 8, 16, 16, 16] and pace_module.MAX_WAIT == 16
    assert missed.after(1, 1, 300, most=4) == Pace(2)  # accepted: the wait and the misses are over


def wrong(token: int) -> int:
    return token - 1 if token > 0 else token + 1


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_adaptive_draft_length_takes_true_or_false_only(checkpoint, value):
    config = checkpoint.speculative_config.SpeculativeConfig
    with pytest.raises(ValueError, match="adaptive_draft_length must be True or False"):
        config.from_dict(NGRAM | {"adaptive_draft_length": value})


class ScriptedProposer:
    """Drafts from the plain greedy answer `answer`: the next `right` of them as they are, then wrong ones (the
    answer's neighbour), as many as asked. Records each request's number of drafts."""

    def __init__(self, checkpoint, answer: list[int], prompt_len: int, right: int):
        self.checkpoint, self.answer, self.prompt_len, self.right = checkpoint, answer, prompt_len, right
        self.asked: list[int] = []

    def propose(self, requests):
        drafts = []
        for request in requests:
            done = len(request.token_ids) - self.prompt_len
            upcoming = self.answer[done : done + request.num_tokens]
            tokens = [t if i < self.right else wrong(t) for i, t in enumerate(upcoming)]
            self.asked.append(request.num_tokens)
            drafts.append(self.checkpoint.proposer.Draft(tokens))
        return drafts

    def forget(self, key):
        pass

    def close(self):
        pass


def scripted_run(checkpoint, model_dir, right: int, adaptive: bool):
    """One greedy request of 20 tokens, k = 4, drafts from `ScriptedProposer`: the numbers of drafts asked
    for, in order, and the engine's counts."""
    params = checkpoint.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    token_ids = prompt(0, 6)
    plain = engine(checkpoint, model_dir, budget=64, **REFERENCE)
    plain.add_request("0", token_ids, params)
    answer = run_to_end(plain)["0"]
    speculative = NGRAM | {"num_speculative_tokens": 4, "adaptive_draft_length": adaptive}
    fast = engine(checkpoint, model_dir, speculative, budget=64, **REFERENCE)
    fast.proposer = ScriptedProposer(checkpoint, answer, len(token_ids), right)
    fast.add_request("0", token_ids, params)
    assert run_to_end(fast)["0"] == answer
    return fast.proposer.asked, fast.stats().spec_decode


@pytest.mark.parametrize(
    "right, asked",
    [
        # every draft right: k each step, and fewer only where max_tokens leaves less room
        (4, [4, 4, 4, 3]),
        # the first draft right, the rest wrong: 4 drafts, then 1 accepted + 1 = 2 each time
        (1, [4, 2, 2, 2, 2, 2, 2, 2, 2]),
        # every draft wrong: 4, then one draft after waits of 1, 2, 4 and 8 tokens (the last wait runs to the end)
        (0, [4, 1, 1, 1]),
    ],
    ids=["always-right", "right-once", "always-wrong"],
)
def test_verify_steps_ask_for_what_the_last_one_earned(checkpoint, tiny_model_dirs, right, asked):
    """Hand-worked: the first token comes from the prompt's step; with `right` = 4 a verify step adds 5 tokens
    (1, 6, 11, 16, then room for 3 drafts before 20); with 1, it adds 2 after the first (1, 3, 5, ..., 19);
    with 0 it adds one token, and the pace waits: drafts at 1, 3, 6, 11 tokens, none from 12 to 19."""
    got, counts = scripted_run(checkpoint, tiny_model_dirs["gqa"], right, adaptive=True)
    assert got == asked
    assert (counts.num_drafts, counts.num_draft_tokens) == (len(asked), sum(asked))
    assert counts.num_accepted_tokens == sum(min(right, n) for n in asked)


def test_without_the_pace_every_step_asks_for_k(checkpoint, tiny_model_dirs):
    got, counts = scripted_run(checkpoint, tiny_model_dirs["gqa"], right=0, adaptive=False)
    assert got == [min(4, 19 - done) for done in range(1, 19)]  # a verify step at every token, 1 to 18
    assert counts.num_accepted_tokens == 0


@pytest.mark.parametrize("options", [REFERENCE, {}], ids=["eager", "compiled"])
def test_greedy_is_the_same_with_the_pace_on_and_off(checkpoint, tiny_model_dirs, options):
    """A pool that preempts, a budget that chunks prompts and trims drafts, n = 2 forks: the same tokens as
    the plain engine either way, and fewer drafts proposed with the pace than without."""
    plain = run(engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE), REQUESTS, greedy(checkpoint))
    counts = {}
    for adaptive in (True, False):
        speculative = NGRAM | {"adaptive_draft_length": adaptive}
        fast = engine(checkpoint, tiny_model_dirs["gqa"], speculative, **options)
        result = run(fast, REQUESTS, greedy(checkpoint))
        assert result.tokens == plain.tokens
        assert result.num_preemptions > 0
        counts[adaptive] = fast.stats().spec_decode
    assert 0 < counts[True].num_draft_tokens < counts[False].num_draft_tokens
    assert counts[True].num_accepted_tokens > 0


def test_seeded_sampling_with_the_pace_is_reproducible(checkpoint, tiny_model_dirs):
    """The pace is made from counts, never from timings: two seeded runs give the same answers and the same
    counts of drafts."""

    def params(index, max_tokens):
        return checkpoint.SamplingParams(temperature=0.3, top_p=0.9, seed=index, max_tokens=2 * max_tokens, n=2)

    runs = []
    for _ in range(2):
        llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], NGRAM, **REFERENCE)
        runs.append((run(llm_engine, REQUESTS, params).tokens, llm_engine.stats().spec_decode))
    assert runs[0] == runs[1] and runs[0][1].num_draft_tokens > 0


class Injected(Exception):
    pass


def test_a_commit_that_fails_puts_the_pace_back(checkpoint, tiny_model_dirs, monkeypatch):
    """Two requests verify drafts in one step; adding the second one's tokens raises after the first one's
    verify row has moved its pace: every pace is as before the step. Going on gives the undisturbed tokens."""
    params = checkpoint.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    speculative = NGRAM | {"num_speculative_tokens": 4}

    def started():
        llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], speculative, budget=64, **REFERENCE)
        for index in range(2):
            llm_engine.add_request(str(index), prompt(index, 6), params)
        return llm_engine

    undisturbed = run_to_end(started())
    llm_engine, fired = started(), []
    state_class = checkpoint.output_processor.RequestState
    add_token = state_class.add_token

    def paces():
        return [sample.pace for state in llm_engine.requests.values() for sample in state.samples]

    def failing(state, index, token, finish_reason):
        first, second = llm_engine.requests.get("0"), llm_engine.requests.get("1")
        if not fired and state is second and first is not None and first.samples[0].pace != before[0]:
            fired.append(True)
            raise Injected
        return add_token(state, index, token, finish_reason)

    monkeypatch.setattr(state_class, "add_token", failing)
    finished = {}
    while llm_engine.has_unfinished_requests():
        before = paces()
        try:
            finished |= {o.request_id: o.token_ids for o in llm_engine.step() if o.finished}
        except checkpoint.llm_engine.StepError as error:
            assert isinstance(error.__cause__, Injected)
            assert paces() == before
    assert fired
    assert finished == undisturbed


def run_to_end(llm_engine) -> dict:
    finished = {}
    while llm_engine.has_unfinished_requests():
        finished |= {o.request_id: o.token_ids for o in llm_engine.step() if o.finished}
    return finished
