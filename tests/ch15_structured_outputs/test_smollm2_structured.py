"""Structured outputs on the bundled SmolLM2-135M-Instruct: 100 answers under five JSON schemas (nested
objects, arrays, enums, bounded numbers, required and optional fields), greedy and sampled with seeds, all
parse and validate; regex and choice answers all match; a constraint that allows every text leaves greedy
answers as they are."""

import json
import re

import jsonschema
import pytest

pytestmark = [pytest.mark.model, pytest.mark.requires("structured_outputs")]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4}
        },
        "required": ["items"],
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]}, "sure": {"type": "boolean"}},
        "required": ["mood", "sure"],
    },
    "bounded numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["age", "score"],
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genre": {"enum": ["drama", "comedy"]},
        },
        "required": ["title"],
    },
}
QUESTIONS = [
    "Give me a JSON record about a person.",
    "Answer in JSON: describe your favourite film.",
    "Reply with JSON about a trip to the sea.",
    "Fill in this JSON form for a fictional customer.",
]
SAMPLES = 4  # per question and schema, beside the greedy answer: 5 schemas x 4 questions x 5 = 100


def chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.latest_only
def test_100_answers_under_five_schemas_all_validate(checkpoint, smollm2_llm):
    llm = smollm2_llm
    prompts, params = [], []
    for schema in SCHEMAS.values():
        constraint = checkpoint.StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        for index, question in enumerate(QUESTIONS):
            prompts += [chat(llm, question)] * 2
            params += [
                checkpoint.SamplingParams(temperature=0, max_tokens=96, structured_outputs=constraint),
                checkpoint.SamplingParams(
                    temperature=0.8, seed=index, n=SAMPLES, max_tokens=96, structured_outputs=constraint
                ),
            ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    answers = [
        (schema, answer)
        for output, schema in zip(outputs, [s for s in SCHEMAS.values() for _ in range(8)])
        for answer in output.outputs
    ]
    assert len(answers) == 100
    for schema, answer in answers:
        assert answer.finish_reason == "stop", answer.text
        jsonschema.validate(json.loads(answer.text), schema)


def test_regex_and_choice_answers_all_match(checkpoint, smollm2_llm):
    llm = smollm2_llm
    cases = [
        (
            checkpoint.StructuredOutputsParams(regex=r"[A-Z][a-z]{1,12}, [0-9]{1,3} (km|miles)"),
            "How far is Paris from Lyon?",
        ),
        (checkpoint.StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"), "When did the first moon landing happen?"),
        (checkpoint.StructuredOutputsParams(choice=["positive", "negative", "neutral"]), "Sentiment of: I love it!"),
        (checkpoint.StructuredOutputsParams(choice=['"quoted"', "back\\slash", "plain"]), "Pick one option."),
    ]
    prompts = [chat(llm, question) for _, question in cases for _ in range(2)]
    params = [
        checkpoint.SamplingParams(temperature=temperature, seed=7, n=n, max_tokens=24, structured_outputs=constraint)
        for constraint, _ in cases
        for temperature, n in ((0, 1), (1.0, 4))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, (constraint, _) in zip(outputs, [case for case in cases for _ in range(2)]):
        for answer in output.outputs:
            assert answer.finish_reason == "stop"
            if constraint.regex is not None:
                assert re.fullmatch(constraint.regex, answer.text), answer.text
            else:
                assert answer.text in constraint.choice


def test_a_constraint_that_allows_every_text_leaves_greedy_answers_unchanged(checkpoint, smollm2_llm):
    llm = smollm2_llm
    prompts = [chat(llm, q) for q in ("Write a haiku about caches.", "What is 2+2?", "Tell me a joke about JSON.")]
    plain = checkpoint.SamplingParams(temperature=0, max_tokens=40)
    anything = checkpoint.SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=checkpoint.StructuredOutputsParams(regex=r"[\s\S]*")
    )
    expected = [o.token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, anything, use_tqdm=False)] == expected
    assert any(o[-1] in llm.llm_engine.eos_token_ids for o in expected)  # the stop token too, where it may end
