"""Speculative decoding in the engine: greedy with speculation equals greedy without, token for token.

On tiny random models, with n-gram prompt lookup and with draft models (the target itself: every draft is
accepted; the target with noise on its weights: some are), under a pool small enough to preempt, a budget small
enough to chunk prompts and to trim drafts, shared prefixes that hit the cache, n > 1, stop tokens, stop
strings, `max_tokens` and aborts in the middle of accepted runs. After every step a sequence holds blocks
for its computed tokens only, and the prefix cache remembers only blocks full of them; at the end every
block of both pools is free. A step that fails while proposing, forwarding or verifying leaves the engine
as it was.
"""

import dataclasses
import shutil

import pytest
import torch

from chapters import submodule
from tests.ch07_continuous_batching.test_transactional_step import Injected, assert_same, snapshot
from tests.ch09_prefix_caching.engine_runs import run
from tests.ch11_cpu_performance.test_fast_path import REFERENCE, REQUESTS, SHARED, prompt

pytestmark = pytest.mark.requires("speculative_decoding")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def other_tiny_model(tiny_model_dirs, tmp_path_factory):
    """The tiny "gqa" model with 5 % noise on every weight (seeded): a draft the target agrees with about
    a quarter of the time, so that runs are accepted in part."""
    from transformers import LlamaForCausalLM

    source, folder = tiny_model_dirs["gqa"], tmp_path_factory.mktemp("noisy-draft")
    model = LlamaForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 0.05)
    model.save_pretrained(folder)
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, folder)
    return folder


def draft_of(path) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path), "quantization": None}


def engine(checkpoint, path, speculative=None, budget: int = 8, **options):
    """A pool a third larger than the largest request needs (running requests preempt), a budget of 8."""
    largest = max(-(-(len(p) + 3 * n) // BLOCK_SIZE) for _, p, n in REQUESTS)
    return checkpoint.LLMEngine(
        str(path),
        block_size=BLOCK_SIZE,
        num_kv_blocks=largest + largest // 3,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        watermark=0.0,
        speculative_config=speculative,
        **options,
    )


def greedy(checkpoint):
    def params(index, max_tokens):  # every third request: two greedy answers sharing the prompt (a fork)
        return checkpoint.SamplingParams(
            temperature=0, max_tokens=3 * max_tokens, ignore_eos=True, n=1 + (index % 3 == 1)
        )

    return params


def checked_steps(engine) -> list:
    """Wrap `engine.step`: after every step, each running sequence holds blocks for its computed tokens
    and no more, and every block the prefix cache remembers in its table is full of computed tokens.
    Returns the list of each step's outputs."""
    step, steps = engine.step, []

    def checked_step():
        steps.append(step())
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK_SIZE), seq.request_id
            for index, block_id in enumerate(seq.block_table):
                if block_id in engine.block_manager.allocator.block_hashes:
                    assert (index + 1) * BLOCK_SIZE <= seq.num_computed_tokens
        return steps[-1]

    engine.step = checked_step
    return steps


def speculative_configs(tiny_model_dirs, other_tiny_model) -> dict:
    return {
        "ngram": NGRAM,
        "draft itself": draft_of(tiny_model_dirs["gqa"]),
        "draft other": draft_of(other_tiny_model),
    }


@pytest.mark.parametrize(
    "proposer, options",
    [
        ("ngram", REFERENCE),
        ("ngram", {}),
        ("draft itself", REFERENCE),
        ("draft other", REFERENCE),
    ],
    ids=[
        "ngram-eager",
        "ngram-compiled",
        "draft-itself-eager",
        "draft-other-eager",
    ],  # a compiled draft: test_draft_proposer
)
def test_greedy_with_speculation_equals_greedy_without(
    checkpoint, tiny_model_dirs, other_tiny_model, proposer, options
):
    speculative = speculative_configs(tiny_model_dirs, other_tiny_model)[proposer]
    plain = run(engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE), REQUESTS, greedy(checkpoint))
    fast = engine(checkpoint, tiny_model_dirs["gqa"], speculative, **options)
    checked_steps(fast)
    result = run(fast, REQUESTS, greedy(checkpoint))
    assert result.tokens == plain.tokens
    stats = fast.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if proposer == "draft itself":  # the target's own drafts: all accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert result.num_preemptions > 0 and sum(result.num_cached_tokens.values()) > 0  # both were in play
    assert any(any(plan.drafts) and not all(plan.samples) for plan in result.plans)  # verified beside a chunk
    assert max(len(p) for _, p, _ in REQUESTS) > 8  # prompts were chunked
    if proposer.startswith("draft"):
        draft_pool = fast.proposer
        assert draft_pool.num_free_blocks == draft_pool.num_total_blocks


def test_a_prompt_hits_blocks_filled_by_accepted_drafts(checkpoint, tiny_model_dirs):
    """Blocks filled by accepted drafts are remembered under the right hashes: a later prompt made of the
    first request's prompt and answer reads them, and continues exactly as without speculation."""
    params = checkpoint.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = SHARED + prompt(0, 4)
    answers = {}
    for name, speculative in (("plain", None), ("ngram", NGRAM)):
        llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], speculative, budget=64, enable_prefix_caching=True)
        (output,) = run(llm_engine, [(1, first, 8)], lambda i, n: params).tokens.values()
        follow_up = first + output[0][:20]
        result = run(llm_engine, [(1, follow_up, 8)], lambda i, n: params)
        answers[name] = (output, result.tokens, result.num_cached_tokens["0"])
        if speculative is not None:
            assert llm_engine.stats().spec_decode.num_accepted_tokens > 0
    assert answers["ngram"] == answers["plain"]
    assert answers["ngram"][2] > len(first) + BLOCK_SIZE  # the hit reached into the generated blocks


def outputs_of(llm_engine, prompts, params) -> list:
    for index, token_ids in enumerate(prompts):
        llm_engine.add_request(str(index), token_ids, params)
    finished = {}
    while llm_engine.has_unfinished_requests():
        finished |= {output.request_id: output for output in llm_engine.step() if output.finished}
    assert llm_engine.block_manager.num_free_blocks == llm_engine.block_manager.num_total_blocks
    return [(o.token_ids, o.text, o.finish_reason) for _, o in sorted(finished.items())]


def test_stops_inside_an_accepted_run_end_where_the_plain_engine_ends(checkpoint, tiny_model_dirs):
    """A stop token, a stop string or max_tokens falling inside a run of accepted drafts: the answer ends
    there, with the same tokens, text and finish reason as without speculation (nothing past the stop)."""
    plain = engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE)
    fast = engine(checkpoint, tiny_model_dirs["gqa"], NGRAM, **REFERENCE)
    prompts = [prompt(i, 6 + 3 * i) for i in range(4)]
    base = checkpoint.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long_answers = outputs_of(plain, prompts, base)
    cases = [checkpoint.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 13, 22)]
    for tokens, text, _ in long_answers:
        cases.append(checkpoint.SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[17]]))
        if len(text) > 12:
            cases.append(checkpoint.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=text[9:12]))
    for params in cases:
        assert outputs_of(fast, prompts, params) == outputs_of(plain, prompts, params), params
    assert fast.stats().spec_decode.num_accepted_tokens > 0


def test_an_abort_in_the_middle_frees_every_block_of_both_pools(checkpoint, tiny_model_dirs):
    plain = engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE)
    fast = engine(checkpoint, tiny_model_dirs["gqa"], draft_of(tiny_model_dirs["gqa"]), **REFERENCE)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [prompt(i, 5 + i) for i in range(3)]
    for index, token_ids in enumerate(prompts):
        fast.add_request(str(index), token_ids, params)
    while fast.stats().spec_decode.num_accepted_tokens == 0:
        fast.step()
    draft_pool = fast.proposer
    assert draft_pool.num_free_blocks < draft_pool.num_total_blocks
    assert fast.abort_request("1")
    finished = {}
    while fast.has_unfinished_requests():
        finished |= {o.request_id: o.token_ids for o in fast.step() if o.finished}
    assert finished == {
        "0": outputs_of(plain, prompts[:1], params)[0][0],
        "2": outputs_of(plain, prompts[2:], params)[0][0],
    }
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_total_blocks
    assert draft_pool.num_free_blocks == draft_pool.num_total_blocks


def fail_in(checkpoint, where: str, monkeypatch, should_fail, llm_engine) -> None:
    """The named part of a speculative step raises `Injected` when `should_fail()` says so."""
    if where == "verify":
        owner, name = submodule(checkpoint, "llm_engine"), "accept_greedy"
    elif where == "propose":
        owner, name = llm_engine.proposer, "propose"
    else:
        owner, name = llm_engine.model_runner, "forward"
    original = getattr(owner, name)

    def failing(*args):
        if should_fail():
            raise Injected(where)
        return original(*args)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize("where", ["propose", "forward", "verify"])
def test_a_step_that_fails_while_speculating_changes_nothing(checkpoint, tiny_model_dirs, monkeypatch, where):
    """The k-th call of the proposer, the forward or the verifier raises once, for several k: right after,
    the engine is as before the step (queues, sequences, blocks, keys and values, random streams); going on
    gives the tokens of an undisturbed run."""
    params = checkpoint.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [prompt(i, 5 + 2 * i) for i in range(3)]
    expected = outputs_of(engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE), prompts, params)
    for fail_at in (2, 5, 9):
        llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], draft_of(tiny_model_dirs["gqa"]), **REFERENCE)
        calls = {"n": 0}

        def should_fail(fail_at=fail_at, calls=calls):
            calls["n"] += 1
            return calls["n"] == fail_at

        with monkeypatch.context() as patched:
            fail_in(checkpoint, where, patched, should_fail, llm_engine)
            for index, token_ids in enumerate(prompts):
                llm_engine.add_request(str(index), token_ids, params)
            finished, fired = {}, False
            while llm_engine.has_unfinished_requests():
                before = snapshot(checkpoint, llm_engine)
                try:
                    finished |= {o.request_id: o for o in llm_engine.step() if o.finished}
                except checkpoint.llm_engine.StepError as error:
                    assert isinstance(error.__cause__, Injected)
                    assert_same(before, snapshot(checkpoint, llm_engine))
                    fired = True
        assert fired
        assert [(o.token_ids, o.text, o.finish_reason) for _, o in sorted(finished.items())] == expected
        assert llm_engine.stats().spec_decode.num_accepted_tokens > 0


def test_seeded_sampling_with_speculation_is_reproducible(checkpoint, tiny_model_dirs, other_tiny_model):
    """Sampled requests go through the rejection rule (its law is checked in test_rejection_sampler.py):
    with seeds, two runs give the same answers, and drafts were both accepted and rejected (k drafts at every
    step where a checkpoint can choose fewer: chapter 18's `adaptive_draft_length`)."""

    def params(index, max_tokens):
        return checkpoint.SamplingParams(temperature=0.3, top_p=0.9, seed=index, max_tokens=2 * max_tokens, n=2)

    options = {field.name for field in dataclasses.fields(checkpoint.speculative_config.SpeculativeConfig)}
    fixed = {"adaptive_draft_length": False} if "adaptive_draft_length" in options else {}
    for speculative in (NGRAM | fixed, draft_of(other_tiny_model) | fixed):
        runs = []
        for _ in range(2):
            llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], speculative, **REFERENCE)
            runs.append(run(llm_engine, REQUESTS, params).tokens)
            stats = llm_engine.stats().spec_decode
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert runs[0] == runs[1]


def test_the_counts_per_request_add_up(checkpoint, tiny_model_dirs):
    """Each request's `spec_decode` counts its own drafts; the engine's are their sum; every forward that
    samples for a request gives it one token and the drafts it accepted."""
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], NGRAM, budget=64, **REFERENCE)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm_engine.add_request("0", prompt(0, 12), params)
    steps_with_tokens, last = 0, None
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            steps_with_tokens += 1
            last = output
    counts = last.spec_decode
    assert counts == llm_engine.stats().spec_decode
    assert steps_with_tokens == len(last.token_ids) - counts.num_accepted_tokens
    assert counts.num_accepted_tokens > 0
    assert counts.mean_acceptance_length == 1 + counts.num_accepted_tokens / counts.num_drafts
    plain = engine(checkpoint, tiny_model_dirs["gqa"], budget=64, **REFERENCE)
    plain.add_request("0", prompt(0, 12), params)
    while plain.has_unfinished_requests():
        assert all(output.spec_decode is None for output in plain.step())
    assert plain.stats().spec_decode is None


def test_speculation_is_off_while_a_batch_of_disable_by_batch_size_runs(checkpoint, tiny_model_dirs):
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], NGRAM | {"disable_by_batch_size": 2}, budget=64)
    for request_id, max_tokens in (("long", 60), ("short", 10)):
        params = checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm_engine.add_request(request_id, prompt(len(request_id), 6), params)
    while llm_engine.has_unfinished_requests():
        running, drafts = len(llm_engine.scheduler.running), llm_engine.stats().spec_decode.num_drafts
        llm_engine.step()
        if running >= 2:
            assert llm_engine.stats().spec_decode.num_drafts == drafts
    assert llm_engine.stats().spec_decode.num_drafts > 0  # the long one speculated once it ran alone


@pytest.mark.parametrize(
    "speculative, options, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, {}, "ngram, draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, {}, ">= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, {}, ">= 2 or None"),
        ({"method": "ngram"}, {}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 8}, {"max_num_batched_tokens": 8}, "max_num_batched_tokens (8)"),
        ({"method": "ngram", "num_speculative_tokens": 9}, {"max_model_len": 10}, "max_model_len (10)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, {}, "unknown keys ['lookahead']"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            {},
            "min <= max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "gguf"}, {}, "gguf"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int2"}, {}, "int8, int4"),
    ],
)
def test_bad_speculative_options_fail_before_anything_loads(
    checkpoint, tiny_model_dirs, monkeypatch, speculative, options, message
):
    loader = submodule(checkpoint, "loader")
    monkeypatch.setattr(loader, "load_model", lambda *args, **kwargs: pytest.fail("a weight was loaded"))
    with pytest.raises(
        ValueError, match="speculative|num_speculative|prompt_lookup|quantization|gguf|disable"
    ) as error:
        checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), speculative_config=speculative, **options)
    assert message in str(error.value)


def test_smollm2_copying_its_prompt_with_ngram_equals_plain_greedy(checkpoint, smollm2_path):
    """On the bundled model, an answer that copies its prompt: n-gram drafts are mostly accepted (more than
    1.5 tokens per forward) and the answer is plain greedy's."""
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door."
    prompt_text = f"<|im_start|>user\nRepeat this sentence exactly, twice: {text}<|im_end|>\n<|im_start|>assistant\n"
    params = checkpoint.SamplingParams(temperature=0, max_tokens=32)
    answers = []
    for speculative in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}):
        with checkpoint.LLM(str(smollm2_path), enforce_eager=True, speculative_config=speculative) as llm:
            (output,) = llm.generate([prompt_text], params, use_tqdm=False)
        answers.append(output.token_ids)
    assert answers[1] == answers[0]
    counts = output.spec_decode
    assert len(output.token_ids) / (len(output.token_ids) - counts.num_accepted_tokens) > 1.5, counts


def test_drafts_never_starve_the_decodes_at_the_end_of_the_running_queue(checkpoint, tiny_model_dirs):
    """16 sequences decoding with 4 drafts each want 80 tokens of a budget of 32: the drafts share what the
    16 decodes leave, and every sequence gets a token every step."""
    llm_engine = checkpoint.LLMEngine(
        str(tiny_model_dirs["gqa"]),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        speculative_config=draft_of(tiny_model_dirs["gqa"]) | {"num_speculative_tokens": 4},
        **REFERENCE,
    )
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for index in range(16):
        llm_engine.add_request(str(index), prompt(index, 2), params)
    full_steps = 0
    while llm_engine.has_unfinished_requests():
        decoding = {seq.request_id for seq in llm_engine.scheduler.running if seq.output_token_ids}
        advanced = {output.request_id for output in llm_engine.step()}
        assert decoding <= advanced, f"starved: {sorted(decoding - advanced, key=int)}"
        full_steps += len(decoding) == 16
    assert full_steps >= 2
    assert llm_engine.stats().spec_decode.num_accepted_tokens > 0


def test_a_preempted_sequence_gives_its_draft_pool_blocks_back(checkpoint, tiny_model_dirs):
    """Under a pool that preempts, the draft model holds records (and blocks) for running sequences only, so
    its pool, as small as the target's, never fills with the preempted ones' and drafting goes on to the end."""
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], draft_of(tiny_model_dirs["gqa"]), **REFERENCE)
    proposer, preemptions, drafts_after_preemption = llm_engine.proposer, 0, 0
    schedule = llm_engine.scheduler.schedule

    def counting_schedule(*args):
        nonlocal preemptions
        plan = schedule(*args)
        preemptions += len(plan.preempted)
        return plan

    llm_engine.scheduler.schedule = counting_schedule
    for index, (_, tokens, max_tokens) in enumerate(REQUESTS):
        llm_engine.add_request(str(index), tokens, greedy(checkpoint)(index, max_tokens))
    while llm_engine.has_unfinished_requests():
        drafts = llm_engine.stats().spec_decode.num_drafts
        llm_engine.step()
        assert set(proposer.records) <= set(llm_engine.scheduler.running)
        if preemptions:
            drafts_after_preemption += llm_engine.stats().spec_decode.num_drafts - drafts
    assert preemptions > 0 and drafts_after_preemption > 0
    assert proposer.num_free_blocks == proposer.num_total_blocks


def test_drafts_dropped_after_a_stop_inside_an_accepted_run_are_not_counted(checkpoint, tiny_model_dirs):
    """A draft model that is the target itself has every draft accepted; a stop token at the first or second
    of a run of 3 ends the answer there, and the counts say what was kept: the drafts up to the stop, not
    the ones after it nor the target's own token."""
    plain = engine(checkpoint, tiny_model_dirs["gqa"], budget=64, **REFERENCE)
    plain.add_request("0", prompt(0, 12), checkpoint.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while plain.has_unfinished_requests():
        (output,) = plain.step()
    tokens = output.token_ids
    stop_at = next(i for i in (2, 1) if tokens[i] not in tokens[:i])  # drafts 1 .. 3 follow token 0
    speculative = engine(checkpoint, tiny_model_dirs["gqa"], draft_of(tiny_model_dirs["gqa"]), budget=64, **REFERENCE)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[tokens[stop_at]])
    speculative.add_request("0", prompt(0, 12), params)
    while speculative.has_unfinished_requests():
        (output,) = speculative.step()
    assert output.token_ids == tokens[: stop_at + 1] and output.finish_reason == "stop"
    assert output.spec_decode.num_draft_tokens == 3
    assert output.spec_decode.num_accepted_tokens == stop_at
    assert speculative.stats().spec_decode == output.spec_decode
