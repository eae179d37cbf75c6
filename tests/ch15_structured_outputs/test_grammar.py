"""The pieces of structured outputs on their own: the constraint's parameters, the grammar cache, one
answer's grammar state (masks, drafts, stepping back), and the bitmask on the logits, checked against
xgrammar's own kernel for the bit order."""

import importlib

import pytest
import torch
import xgrammar

from chapters import submodule

pytestmark = pytest.mark.requires("structured_outputs")


@pytest.fixture
def grammar(checkpoint):
    return submodule(checkpoint, "grammar")


@pytest.fixture
def cache(checkpoint, grammar, tiny_model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["gqa"])
    return grammar.GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def encode(cache, text: str) -> list[int]:
    return cache.tokenizer.encode(text, add_special_tokens=False)


def allowed(grammar, state, vocab_size: int) -> set[int]:
    bitmask = grammar.allocate_bitmask(1, vocab_size)
    state.fill_mask(bitmask, 0)
    token_bitmask = importlib.import_module(f"{grammar.__package__}.token_bitmask")
    return set(token_bitmask.unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist())


def test_params_key_is_equal_for_equal_constraints_and_unknown_keys_are_named(checkpoint):
    structured = checkpoint.StructuredOutputsParams
    assert structured(json={"a": 1, "b": 2}).key == structured(json='{"b": 2, "a": 1}').key
    assert structured(json={"a": 1}).key != structured(json={"a": 1}, disable_any_whitespace=True).key
    assert structured(regex="a").key != structured(grammar="a").key
    assert structured.from_dict({"choice": ["x"]}).choice == ["x"]
    with pytest.raises(ValueError, match=r"unknown keys \['guided_json'\]"):
        structured.from_dict({"guided_json": {}})


def test_every_choice_is_accepted_whole_then_the_stop_token_and_nothing_else(checkpoint, grammar, cache):
    choices = ['say "hi"', "back\\slash", "yes", "yes!"]
    compiled = cache.compile(checkpoint.StructuredOutputsParams(choice=choices))
    eos = cache.tokenizer.eos_token_id
    for choice in choices:
        state = grammar.GrammarState(compiled)
        for token in encode(cache, choice):
            state.accept(token)
        assert not state.finished
        state.accept(eos)
        assert state.finished
    state = grammar.GrammarState(compiled)
    with pytest.raises(RuntimeError, match="does not allow"):
        for token in encode(cache, "no"):
            state.accept(token)


def test_the_stop_token_is_allowed_only_where_the_grammar_may_end(checkpoint, grammar, cache):
    structured = checkpoint.StructuredOutputsParams
    state = grammar.GrammarState(cache.compile(structured(regex="ab(cd)?")))
    eos, vocab_size = cache.tokenizer.eos_token_id, len(cache.tokenizer)
    seen = []
    for text in ["a", "b", "c", "d"]:
        seen.append(eos in allowed(grammar, state, vocab_size))
        (token,) = encode(cache, text)
        state.accept(token)
    seen.append(eos in allowed(grammar, state, vocab_size))
    assert seen == [False, False, True, False, True]
    assert allowed(grammar, state, vocab_size) == {eos}  # "abcd" is complete: only the stop token


def test_drafts_are_checked_and_masked_without_moving_the_state(checkpoint, grammar, cache):
    structured = checkpoint.StructuredOutputsParams
    state = grammar.GrammarState(cache.compile(structured(regex="[0-9]{3}")))
    vocab_size = len(cache.tokenizer)
    before = allowed(grammar, state, vocab_size)
    digits, letter = [encode(cache, d)[0] for d in "123"], encode(cache, "x")[0]
    assert state.valid_prefix(digits[:2] + [letter] + digits[2:]) == 2
    assert allowed(grammar, state, vocab_size) == before
    bitmask = grammar.allocate_bitmask(4, vocab_size)
    state.fill_draft_masks(bitmask, [digits[0], letter, digits[1]])
    unpack = importlib.import_module(f"{grammar.__package__}.token_bitmask").unpack_bitmask
    rows = unpack(bitmask, vocab_size)  # [4, vocab]
    assert not rows[1, letter] and rows[1, digits[1]]  # after the first digit: a digit, not a letter
    assert rows[2].all() and rows[3].all()  # after the refused letter: nothing is read, all allowed
    assert allowed(grammar, state, vocab_size) == before


@pytest.mark.parametrize("vocab_size", [64, 100])
def test_the_bitmask_on_the_logits_agrees_with_xgrammars_kernel(checkpoint, vocab_size):
    token_bitmask = submodule(checkpoint, "token_bitmask")
    generator = torch.Generator().manual_seed(0)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(5, vocab_size, generator=generator)  # [5, vocab]: rows 1, 2, 4 constrained
    ours = logits.clone()
    token_bitmask.apply_bitmask(ours, [1, 2, 4], bitmask)
    theirs = logits.clone()
    full = torch.full((5, words), -1, dtype=torch.int32)
    full[[1, 2, 4]] = bitmask
    xgrammar.apply_token_bitmask_inplace(theirs, full)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 3]], logits[[0, 3]])  # unconstrained rows untouched
    assert (ours[[1, 2, 4]] == float("-inf")).any()


def test_length_bounded_json_strings_refuse_raw_control_characters(checkpoint, grammar, cache):
    structured = checkpoint.StructuredOutputsParams
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    state = grammar.GrammarState(cache.compile(structured(json=schema, disable_any_whitespace=True)))
    for token in encode(cache, '{"s":"'):
        state.accept(token)
    tab, letter = encode(cache, "\t"), encode(cache, "a")
    mask = allowed(grammar, state, len(cache.tokenizer))
    assert letter[0] in mask and tab[0] not in mask
