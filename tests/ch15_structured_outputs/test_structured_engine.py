"""Structured outputs in the engine, on tiny random models: every constrained answer matches its constraint,
and constraining changes nothing else.

A random model is the hardest writer a grammar can have: left alone it emits noise, so only the mask makes
its answers parse. The constraints below have finite languages, so every answer reaches the grammar's end
and stops there (the stop token is the only token allowed at the end). Differential checks: unconstrained
requests beside constrained ones get exactly the tokens they get alone, and constrained answers are the
same under a pool small enough to preempt, a budget small enough to chunk prompts, prefix-cache hits, n > 1,
speculative decoding (whose drafts the grammar cuts) and a step that fails and is run again.
"""

import json
import re

import jsonschema
import pytest

from chapters import submodule
from tests.ch07_continuous_batching.test_transactional_step import Injected, assert_same, snapshot
from tests.ch09_prefix_caching.engine_runs import run
from tests.ch11_cpu_performance.test_fast_path import REFERENCE, REQUESTS

pytestmark = pytest.mark.requires("structured_outputs")

REGEX = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "colour"],
}
CHOICES = ["yes", "no", 'say "hi"', "back\\slash"]
MAX_TOKENS = 64  # more than the longest answer any of these constraints allows, in tiny-tokenizer tokens
BLOCK_SIZE = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def constraint(checkpoint, index: int):
    """Request `index`'s constraint: a regex, a JSON schema, a choice, or (every fourth) none."""
    structured = checkpoint.StructuredOutputsParams
    return [
        structured(regex=REGEX),
        structured(json=SCHEMA, disable_any_whitespace=True),
        structured(choice=CHOICES),
        None,
    ][index % 4]


def assert_matches(constraint, text: str) -> None:
    if constraint is None:
        return
    if constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice
    else:
        jsonschema.validate(json.loads(text), constraint.json)


def engine(checkpoint, path, budget: int = 256, small_pool: bool = False, **options):
    """Blocks of 4; a pool for every request at once, or (`small_pool`) just what the largest needs, so that
    running requests preempt each other."""
    largest = max(-(-(len(p) + MAX_TOKENS) // BLOCK_SIZE) for _, p, _ in REQUESTS)
    return checkpoint.LLMEngine(
        str(path),
        block_size=BLOCK_SIZE,
        num_kv_blocks=largest if small_pool else largest * len(REQUESTS),
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        watermark=0.0,
        **options,
    )


def greedy(checkpoint, n: int = 1):
    def params(index, _):
        return checkpoint.SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, n=n, structured_outputs=constraint(checkpoint, index)
        )

    return params


def seeded(checkpoint, n: int = 1):
    def params(index, _):
        return checkpoint.SamplingParams(
            temperature=0.9,
            top_p=0.95,
            seed=index,
            max_tokens=MAX_TOKENS,
            n=n,
            structured_outputs=constraint(checkpoint, index),
        )

    return params


def assert_every_answer_matches(checkpoint, llm_engine, result) -> None:
    for request_id, answers in result.tokens.items():
        for tokens in answers:
            assert_matches(
                constraint(checkpoint, int(request_id)), llm_engine.tokenizer.decode(tokens, skip_special_tokens=True)
            )


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_constrained_answer_matches_and_stops_at_the_grammars_end(checkpoint, tiny_model_dirs, sampling):
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE)
    params = greedy(checkpoint) if sampling == "greedy" else seeded(checkpoint)
    for index, (_, token_ids, _) in enumerate(REQUESTS):
        llm_engine.add_request(str(index), token_ids, params(index, None))
    finished = {}
    while llm_engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in llm_engine.step() if o.finished}
    for request_id, output in finished.items():
        index = int(request_id)
        if constraint(checkpoint, index) is not None:
            assert_matches(constraint(checkpoint, index), output.text)
            assert output.finish_reason == "stop" and output.token_ids[-1] in llm_engine.eos_token_ids
        else:  # a random model left alone writes noise that matches none of them
            assert not re.fullmatch(REGEX, output.text) and output.text not in CHOICES
    assert len(finished) == len(REQUESTS)


def test_unconstrained_requests_beside_constrained_ones_get_their_tokens_alone(checkpoint, tiny_model_dirs):
    """Every fourth request is unconstrained; run with the others (greedy and seeded, in one batch), it
    gets exactly the tokens it gets in a run of the unconstrained requests only."""
    alone = [request if index % 4 == 3 else (request[0], request[1], 0) for index, request in enumerate(REQUESTS)]

    def mixed_params(index, max_tokens):
        params = (greedy if index % 2 else seeded)(checkpoint)(index, max_tokens)
        return checkpoint.SamplingParams(**{**vars(params), "max_tokens": max_tokens or 1})

    together = run(engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE), REQUESTS, mixed_params)
    unconstrained = [request for index, request in enumerate(alone) if request[2]]
    by_itself = run(
        engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE),
        unconstrained,
        lambda i, n: mixed_params(3 + 4 * i, n),
    )
    assert [together.tokens[str(3 + 4 * i)] for i in range(len(unconstrained))] == [
        by_itself.tokens[str(i)] for i in range(len(unconstrained))
    ]


def grammar_cuts(checkpoint, monkeypatch) -> list[int]:
    """Wrap `GrammarState.valid_prefix`: returns a list that gets, per draft checked, how many of its tokens
    the grammar refused."""
    grammar = submodule(checkpoint, "grammar")
    original, cuts = grammar.GrammarState.valid_prefix, []

    def recording(self, token_ids):
        valid = original(self, token_ids)
        cuts.append(len(token_ids) - valid)
        return valid

    monkeypatch.setattr(grammar.GrammarState, "valid_prefix", recording)
    return cuts


def draft_of_itself(tiny_model_dirs) -> dict:
    return {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "model": str(tiny_model_dirs["gqa"]),
        "quantization": None,
    }


@pytest.mark.parametrize(
    "disturbance", ["preempt-and-chunk", "prefix-hits", "n=2", "ngram", "draft-model", "draft-model-n=2"]
)
def test_constrained_answers_are_those_of_an_undisturbed_run(checkpoint, tiny_model_dirs, monkeypatch, disturbance):
    """The same requests, greedy (and, where the streams are drawn alike, seeded), on a roomy engine and on one
    that preempts and chunks, hits the prefix cache, forks n = 2 answers or speculates: the same tokens, and
    every answer matches its constraint."""
    n = 2 if disturbance.endswith("n=2") else 1
    options = {
        "preempt-and-chunk": dict(budget=8, small_pool=True),
        "prefix-hits": dict(budget=8, enable_prefix_caching=True),
        "n=2": dict(budget=8, small_pool=True, enable_prefix_caching=True),
        "ngram": dict(budget=8, speculative_config=NGRAM),
        "draft-model": dict(budget=8, small_pool=True, speculative_config=draft_of_itself(tiny_model_dirs)),
        "draft-model-n=2": dict(budget=8, speculative_config=draft_of_itself(tiny_model_dirs)),
    }[disturbance]
    samplings = [greedy] if "speculative_config" in options else [greedy, seeded]
    cuts = grammar_cuts(checkpoint, monkeypatch)
    for sampling in samplings:
        undisturbed = run(engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE), REQUESTS, sampling(checkpoint, n))
        disturbed_engine = engine(checkpoint, tiny_model_dirs["gqa"], **options, **REFERENCE)
        disturbed = run(disturbed_engine, REQUESTS, sampling(checkpoint, n))
        assert disturbed.tokens == undisturbed.tokens
        assert_every_answer_matches(checkpoint, disturbed_engine, disturbed)
        assert max(len(p) for _, p, _ in REQUESTS) > 8 and any(not all(p.samples) for p in disturbed.plans)  # chunked
        if options.get("small_pool"):
            assert disturbed.num_preemptions > 0
        if options.get("enable_prefix_caching"):
            assert sum(disturbed.num_cached_tokens.values()) > 0
        if "speculative_config" in options:
            assert disturbed_engine.stats().spec_decode.num_accepted_tokens > 0
            assert any(cuts)  # the grammar cut drafts (the draft model's are unconstrained: it cuts most)
            assert disturbance != "ngram" or not all(cuts)  # and kept some of prompt lookup's whole


@pytest.mark.parametrize("proposer", ["ngram", "draft-model"])
def test_sampled_answers_with_speculation_match_and_repeat(checkpoint, tiny_model_dirs, proposer):
    """Seeded sampling while speculating (a draft model's drafts are drawn from its own law; the grammar
    refuses many): every answer matches its constraint, the same seeds give the same answers, and drafts are
    accepted. The law itself is checked on a hand-worked case (test_speculative_grammar.py)."""
    speculative = NGRAM if proposer == "ngram" else draft_of_itself(tiny_model_dirs)
    answers = []
    for _ in range(2):
        llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], budget=8, speculative_config=speculative, **REFERENCE)
        result = run(llm_engine, REQUESTS, seeded(checkpoint))
        assert_every_answer_matches(checkpoint, llm_engine, result)
        assert llm_engine.stats().spec_decode.num_accepted_tokens > 0
        answers.append(result.tokens)
    assert answers[0] == answers[1]


def grammar_masks(checkpoint, llm_engine) -> dict:
    """Every sample's next-token mask: where its grammar stands, as a value that can be compared."""
    grammar = submodule(checkpoint, "grammar")
    masks = {}
    for request_id, state in llm_engine.requests.items():
        for index, sample in enumerate(state.samples):
            if sample.grammar is not None:
                bitmask = grammar.allocate_bitmask(1, llm_engine.model.config.vocab_size)
                sample.grammar.fill_mask(bitmask, 0)
                masks[request_id, index] = bitmask.tolist()
    return masks


def sample_states(llm_engine) -> dict:
    """Every sample's text, finish and tokens: what a step's commit writes beside the bookkeeping."""
    return {
        (request_id, index): (sample.text, sample.finish_reason, None if sample.seq is None else sample.seq.token_ids)
        for request_id, state in llm_engine.requests.items()
        for index, sample in enumerate(state.samples)
    }


@pytest.mark.parametrize("where", ["forward", "mask", "sample", "verify", "accept", "detokenize"])
def test_a_failed_step_leaves_every_grammar_where_it_was(checkpoint, tiny_model_dirs, monkeypatch, where):
    """The k-th forward, grammar mask, sampling, verification, grammar step past a committed token or
    detokenization raises once, for several k: right after, the engine, every sample's grammar and text are as
    before the step; going on gives the tokens of an undisturbed run."""
    speculative = NGRAM if where == "verify" else None
    expected = run(engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE), REQUESTS, greedy(checkpoint, 2)).tokens
    llm_engine_module = submodule(checkpoint, "llm_engine")
    grammar_module = submodule(checkpoint, "grammar")
    detokenizer_module = submodule(checkpoint, "detokenizer")
    for fail_at in (2, 6, 11):
        llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], budget=8, speculative_config=speculative, **REFERENCE)
        owner, name = {
            "forward": (llm_engine.model_runner, "forward"),
            "mask": (llm_engine_module, "mask_logits"),
            "sample": (llm_engine_module, "sample_batch"),
            "verify": (llm_engine_module, "accept_greedy"),
            "accept": (grammar_module.GrammarState, "accept"),
            "detokenize": (detokenizer_module.IncrementalDetokenizer, "add"),
        }[where]
        original, calls = getattr(owner, name), {"n": 0, "fired": False}

        def failing(*args, original=original, calls=calls, fail_at=fail_at):
            calls["n"] += 1
            if calls["n"] == fail_at:
                calls["fired"] = True
                raise Injected(where)
            return original(*args)

        with monkeypatch.context() as patched:
            patched.setattr(owner, name, failing)
            step = llm_engine.step

            def checked_step(llm_engine=llm_engine, step=step):
                before = snapshot(checkpoint, llm_engine), grammar_masks(checkpoint, llm_engine)
                samples = sample_states(llm_engine)
                try:
                    return step()
                except llm_engine_module.StepError as error:
                    assert isinstance(error.__cause__, Injected)
                    assert_same(before[0], snapshot(checkpoint, llm_engine))
                    assert grammar_masks(checkpoint, llm_engine) == before[1]
                    assert sample_states(llm_engine) == samples
                    return []

            llm_engine.step = checked_step
            result = run(llm_engine, REQUESTS, greedy(checkpoint, 2))
        assert calls["fired"]
        assert result.tokens == expected


BAD_CONSTRAINTS = [
    (dict(json={"type": "nope"}), "not a valid JSON schema"),
    (dict(json={"type": "string", "maxLength": -1}), "maxLength"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="(ab"), "regex does not compile"),
    (dict(regex="[a-"), "regex does not compile"),
    (dict(grammar='root ::= item\nitem ::= "a" undefined'), "grammar does not compile"),
    (dict(choice=[]), "non-empty list of strings"),
    (dict(choice=["a", ""]), "non-empty strings"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(), "got none"),
]


@pytest.mark.parametrize("options, message", BAD_CONSTRAINTS, ids=[m for _, m in BAD_CONSTRAINTS])
def test_a_bad_constraint_is_a_value_error_and_nothing_is_queued(checkpoint, tiny_model_dirs, options, message):
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE)
    llm_engine.add_request("ok", [5, 6, 7], checkpoint.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=re.escape(message)):
        params = checkpoint.SamplingParams(structured_outputs=checkpoint.StructuredOutputsParams(**options))
        llm_engine.add_request("bad", [5, 6, 7], params)
    assert set(llm_engine.requests) == {"ok"}
    assert [seq.request_id for seq in llm_engine.scheduler.waiting] == ["ok"]
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    assert llm_engine.block_manager.num_free_blocks == llm_engine.block_manager.num_total_blocks


def test_a_dict_is_not_structured_outputs_params(checkpoint):
    with pytest.raises(ValueError, match="must be StructuredOutputsParams"):
        checkpoint.SamplingParams(structured_outputs={"regex": "a"})


def test_max_tokens_first_ends_with_length_and_incomplete_text(checkpoint, tiny_model_dirs):
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE)
    structured = checkpoint.StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=4, structured_outputs=structured)
    llm_engine.add_request("0", [5, 6, 7], params)
    while llm_engine.has_unfinished_requests():
        (output,) = llm_engine.step()
    assert output.finish_reason == "length" and len(output.token_ids) == 4
    assert output.text.startswith('{"id')
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


def test_each_distinct_constraint_is_compiled_once(checkpoint, tiny_model_dirs):
    """Equal constraints (a schema's keys in another order, or its JSON text) share one compiled grammar;
    the whitespace option makes another."""
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], **REFERENCE)
    structured = checkpoint.StructuredOutputsParams
    same = [
        structured(json=SCHEMA),
        structured(json=dict(reversed(SCHEMA.items()))),
        structured(json=json.dumps(SCHEMA)),
    ]
    for index, constraint_ in enumerate([*same, structured(json=SCHEMA, disable_any_whitespace=True)]):
        llm_engine.add_request(
            str(index), [5, 6], checkpoint.SamplingParams(max_tokens=1, structured_outputs=constraint_)
        )
    assert (llm_engine.grammars.num_compiled, llm_engine.grammars.num_hits) == (2, 2)
