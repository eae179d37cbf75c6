"""The draft-model proposer: its greedy drafts are the draft model's own greedy continuation, however its
record of a sequence went stale; sampled drafts come with the distributions they were drawn from; a pool
too small gives no draft and no error; a draft with another vocabulary is refused before a weight is read."""

import pytest
import torch
from torch._dynamo.utils import counters

from chapters import submodule

pytestmark = pytest.mark.requires("speculative_decoding")

GREEDY = {"temperature": 0}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 60))]


@pytest.fixture
def draft_module(checkpoint):
    return submodule(checkpoint, "draft_proposer")


@pytest.fixture
def make_proposer(checkpoint, draft_module, tiny_model_dirs):
    """A proposer on the tiny "gqa" model, eager; closed after the test."""
    made = []

    def make(num_blocks=64, block_size=4, max_model_len=256, enforce_eager=True):
        proposer = draft_module.DraftModelProposer(
            tiny_model_dirs["gqa"], "cpu", None, None, enforce_eager, None, num_blocks, block_size, max_model_len
        )
        made.append(proposer)
        return proposer

    yield make
    for proposer in made:
        proposer.close()


@pytest.fixture(scope="module")
def oracle_engine(tiny_model_dirs):
    """The draft model alone, as the step engine runs it."""
    from rosellm import LLMEngine

    return LLMEngine(tiny_model_dirs["gqa"], enforce_eager=True, enable_prefix_caching=False)


def greedy_continuation(engine, token_ids: list[int], num_tokens: int) -> list[int]:
    """What the draft model alone generates greedily after `token_ids`."""
    from rosellm import SamplingParams

    engine.add_request("oracle", token_ids, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return list(outputs[-1].token_ids)


def request(checkpoint, key, token_ids, num_tokens, generator=None, **params):
    proposer = submodule(checkpoint, "proposer")
    return proposer.DraftRequest(key, list(token_ids), num_tokens, checkpoint.SamplingParams(**params), generator)


def spy_forwards(proposer, monkeypatch) -> list[list[int]]:
    """The new tokens of every row of every forward the proposer's runner runs from now on."""
    runs = []
    forward = proposer.runner.forward

    def spying(inputs):
        runs.append(list(inputs.num_new_tokens))
        return forward(inputs)

    monkeypatch.setattr(proposer.runner, "forward", spying)
    return runs


def test_greedy_drafts_of_several_requests_equal_the_draft_models_generation(
    checkpoint, make_proposer, oracle_engine, monkeypatch
):
    proposer = make_proposer()
    runs = spy_forwards(proposer, monkeypatch)
    num_tokens = [4, 2, 3]
    requests = [request(checkpoint, key, ids, k, **GREEDY) for key, (ids, k) in enumerate(zip(PROMPTS, num_tokens))]
    drafts = proposer.propose(requests)
    for draft, ids, k in zip(drafts, PROMPTS, num_tokens):
        assert draft.token_ids == greedy_continuation(oracle_engine, ids, k)
        assert draft.probs is None
    # one catch-up forward of every prompt, then one token per row that still wants drafts
    assert runs == [[len(ids) for ids in PROMPTS], [1, 1, 1], [1, 1], [1]]
    # every draft but the last of each has its keys and values written
    for key, (ids, draft) in enumerate(zip(PROMPTS, drafts)):
        assert proposer.records[key].token_ids == ids + draft.token_ids[:-1]


@pytest.mark.parametrize(
    "case, follow_up, recomputed",
    [
        # the target accepted two drafts, then chose its own token
        ("two accepted", lambda ids, drafts, other: ids + drafts[:2] + [other], 1),
        # every draft accepted, plus the target's token: the unwritten last draft runs too
        ("all accepted", lambda ids, drafts, other: ids + drafts + [other], 2),
        # every draft rejected
        ("all rejected", lambda ids, drafts, other: ids + [other], 1),
        # the sequence now differs three tokens before its end (preempted, or another engine's step)
        ("earlier divergence", lambda ids, drafts, other: ids[:-3] + [other] * 3, 3),
    ],
)
def test_a_stale_record_recomputes_only_what_differs(
    checkpoint, make_proposer, oracle_engine, monkeypatch, case, follow_up, recomputed
):
    proposer = make_proposer()
    ids = PROMPTS[0]
    first = proposer.propose([request(checkpoint, "seq", ids, 4, **GREEDY)])[0].token_ids
    other = next(t for t in range(1, 100) if t not in first + ids)  # a token neither drafted nor in the prompt
    ids = follow_up(ids, first, other)
    runs = spy_forwards(proposer, monkeypatch)
    draft = proposer.propose([request(checkpoint, "seq", ids, 4, **GREEDY)])[0]
    assert draft.token_ids == greedy_continuation(oracle_engine, ids, 4)
    assert runs[0] == [recomputed]
    assert proposer.records["seq"].token_ids == ids + draft.token_ids[:-1]


def test_the_same_tokens_again_rerun_only_the_last(checkpoint, make_proposer, oracle_engine, monkeypatch):
    """A step that failed asks again for the same tokens: only the last one runs (its logits are the first
    draft)."""
    proposer = make_proposer()
    first = proposer.propose([request(checkpoint, "seq", PROMPTS[2], 3, **GREEDY)])[0]
    runs = spy_forwards(proposer, monkeypatch)
    again = proposer.propose([request(checkpoint, "seq", PROMPTS[2], 3, **GREEDY)])[0]
    assert again.token_ids == first.token_ids == greedy_continuation(oracle_engine, PROMPTS[2], 3)
    assert runs == [[1], [1], [1]]


def test_a_pool_too_small_gives_an_empty_draft_and_keeps_no_block(checkpoint, make_proposer, oracle_engine):
    proposer = make_proposer(num_blocks=4, block_size=4)  # 16 slots
    short, long = PROMPTS[0], PROMPTS[2]  # 7 + 3 slots fit; 30 do not
    drafts = proposer.propose(
        [request(checkpoint, "long", long, 2, **GREEDY), request(checkpoint, "short", short, 4, **GREEDY)]
    )
    assert drafts[0].token_ids == [] and drafts[0].probs is None
    assert drafts[1].token_ids == greedy_continuation(oracle_engine, short, 4)
    assert "long" not in proposer.records
    assert proposer.num_free_blocks == proposer.num_total_blocks - 3  # ceil(10 / 4)
    # the short one grows until it no longer fits either: its record goes, every block comes back
    assert proposer.propose([request(checkpoint, "short", short + list(range(8)), 4, **GREEDY)])[0].token_ids == []
    assert proposer.records == {}
    assert proposer.num_free_blocks == proposer.num_total_blocks


def test_drafts_past_the_longest_sequence_are_refused(checkpoint, make_proposer):
    proposer = make_proposer(max_model_len=9)
    draft = proposer.propose([request(checkpoint, "seq", PROMPTS[0], 4, **GREEDY)])[0]  # 7 + 3 slots > 9
    assert draft.token_ids == []
    assert proposer.num_free_blocks == proposer.num_total_blocks


def test_forget_returns_every_block(checkpoint, make_proposer):
    proposer = make_proposer()
    proposer.propose([request(checkpoint, key, ids, 3, **GREEDY) for key, ids in enumerate(PROMPTS)])
    assert proposer.num_free_blocks < proposer.num_total_blocks
    for key in range(len(PROMPTS)):
        proposer.forget(key)
    proposer.forget("never proposed")
    assert proposer.records == {}
    assert proposer.num_free_blocks == proposer.num_total_blocks


def test_sampled_drafts_come_with_their_distributions(checkpoint, make_proposer, oracle_engine):
    params = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
    proposer = make_proposer()
    generator = torch.Generator().manual_seed(1)
    draft = proposer.propose([request(checkpoint, "seq", PROMPTS[0], 4, generator, **params)])[0]
    assert len(draft.token_ids) == 4
    assert draft.probs.shape == (4, proposer.vocab_size) and draft.probs.dtype == torch.float32
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(4))
    assert all(draft.probs[i, token] > 0 for i, token in enumerate(draft.token_ids))
    # each row is the draft model's distribution after the tokens before it, filtered as the target filters
    logits = oracle_engine.prompt_logits(PROMPTS[0] + draft.token_ids[:3])[len(PROMPTS[0]) - 1 :]  # [4, vocab]
    rejection_sampler = submodule(checkpoint, "rejection_sampler")
    expected = rejection_sampler.target_probs(logits, checkpoint.SamplingParams(**params))
    torch.testing.assert_close(draft.probs, expected, atol=1e-5, rtol=1e-4)
    assert (draft.probs > 0).sum(-1).max() <= 50

    again = make_proposer().propose(
        [request(checkpoint, "seq", PROMPTS[0], 4, torch.Generator().manual_seed(1), **params)]
    )[0]
    assert again.token_ids == draft.token_ids
    torch.testing.assert_close(again.probs, draft.probs)


def test_a_draft_with_another_vocabulary_is_refused_before_any_weight_is_read(
    checkpoint, tiny_model_dirs, smollm2_path, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("weights were read")

    loader = submodule(checkpoint, "loader")
    runner = submodule(checkpoint, "model_runner")
    quantization = submodule(checkpoint, "quantization")
    for module, name in [
        (loader, "load_model"),
        (loader, "load_file"),
        (loader, "gguf_to_hf_folder"),
        (runner, "load_model"),
        (quantization, "load_gguf_model"),
    ]:
        monkeypatch.setattr(module, name, never)
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(smollm2_path), "quantization": None}
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(49152 tokens\).*target's \(384 tokens\)"):
        checkpoint.LLMEngine(tiny_model_dirs["gqa"], enforce_eager=True, speculative_config=draft)


def test_in_the_engine_every_record_is_forgotten_and_greedy_answers_are_unchanged(checkpoint, tiny_model_dirs):
    """The engine's proposer with the default int4 draft: the answers are the target's own, and once every
    request has finished (or was aborted) the draft's pool is whole again."""
    folder = tiny_model_dirs["gqa"]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = checkpoint.LLM(folder, enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    draft = {"method": "draft_model", "num_speculative_tokens": 3}
    llm = checkpoint.LLM(folder, enforce_eager=True, speculative_config=draft)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in plain]
    assert sum(out.spec_decode.num_draft_tokens for out in outputs) > 0
    proposer = llm.llm_engine.proposer
    assert proposer.records == {} and proposer.num_free_blocks == proposer.num_total_blocks
    engine = llm.llm_engine
    engine.add_request("aborted", PROMPTS[0], params)
    engine.step()  # the prompt, and the first token
    engine.step()  # drafts, verified
    assert list(proposer.records) == [engine.scheduler.running[0]]
    engine.abort_request("aborted")
    assert proposer.records == {} and proposer.num_free_blocks == proposer.num_total_blocks


@pytest.mark.slow
def test_a_compiled_draft_beside_a_compiled_target(checkpoint, make_proposer, oracle_engine, tiny_model_dirs):
    """Two compiled runners in one process (the attention operator, its forward context, packed weights,
    compiled graphs): each computes what it computes alone, and drafting compiles nothing after warm-up."""
    runner_module = submodule(checkpoint, "model_runner")
    step_inputs = submodule(checkpoint, "step_inputs")
    target = runner_module.ModelRunner(tiny_model_dirs["mqa_tied"], "cpu", enforce_eager=False)
    target.allocate_kv_pool(8, 4, 64)
    prompt = PROMPTS[0]
    inputs = step_inputs.StepInputs(prompt, [len(prompt)], [len(prompt)], [[0, 1]], [True])

    def target_logits():
        return target.sampling_logits(target.forward(inputs), inputs)

    before = target_logits()
    proposer = make_proposer(enforce_eager=False)
    graphs = counters["stats"]["unique_graphs"]
    num_tokens = [2, 3, 4]  # one-token forwards of 3 rows, 2, then 1 (the one-token graph)
    requests = [request(checkpoint, key, ids, k, **GREEDY) for key, (ids, k) in enumerate(zip(PROMPTS, num_tokens))]
    for draft, ids, k in zip(proposer.propose(requests), PROMPTS, num_tokens):
        assert draft.token_ids == greedy_continuation(oracle_engine, ids, k)
    torch.testing.assert_close(target_logits(), before, atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] == graphs
    target.close()
