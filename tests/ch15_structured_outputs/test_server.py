"""Structured outputs over HTTP, on a real `python -m rosellm serve` of the bundled SmolLM2 and OpenAI's own
client: `response_format` and vLLM's `structured_outputs` / `guided_*` fields constrain every answer, batched
requests included; a bad constraint is a 400 naming the problem, and nothing is queued."""

import json
import queue
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.ch10_serving.conftest import parse_metrics

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
TIGHT_KEY = {"disable_any_whitespace": True}  # JSON without optional whitespace
TIGHT = {"structured_outputs": TIGHT_KEY}
COLOR_GRAMMAR = 'root ::= "red" | "green" | "blue"'

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "address"],
    "additionalProperties": False,
}
COLORS = {
    "type": "object",
    "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
    },
    "required": ["colors"],
    "additionalProperties": False,
}
MOOD = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["happy", "sad", "calm"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["mood", "score"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "colors": COLORS, "mood": MOOD}
QUESTIONS = {
    "person": "Describe a person who lives in a city, as JSON.",
    "colors": "List your favourite colors as JSON.",
    "mood": "How do you feel today, on a scale of 1 to 10? Answer in JSON.",
}
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 7}}


@pytest.fixture(scope="module")
def client():
    """OpenAI's client on a server of SmolLM2 started once for the module, stopped at its end."""
    command = [sys.executable, "-m", "rosellm", "serve", "--port", "0", "--served-model-name", MODEL, "--enforce-eager"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        while not (address := re.search(r"serving \S+ at (http://\S+/v1)", line := lines.get(timeout=120))):
            assert "Traceback" not in line, line
        with openai.OpenAI(base_url=address.group(1), api_key="unused", max_retries=0, timeout=120) as client:
            yield client
    finally:
        process.terminate()
        process.wait(timeout=30)


def ask(client, endpoint: str, question: str, stream: bool, **options) -> tuple[str, str]:
    """(text, finish_reason) of one answer, from the chat or the completions endpoint, streamed or not."""
    if endpoint == "chat":
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, stream=stream, **options)
        if not stream:
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        chunks = [chunk.choices[0] for chunk in reply if chunk.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    if "response_format" in options:  # not among the completions client's arguments: sent as an extra field
        options["extra_body"] = {"response_format": options.pop("response_format")} | options.get("extra_body", {})
    reply = client.completions.create(model=MODEL, prompt=f"{question}\n", stream=stream, **options)
    if not stream:
        return reply.choices[0].text, reply.choices[0].finish_reason
    chunks = [chunk.choices[0] for chunk in reply if chunk.choices]
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def metrics(client) -> dict[str, float]:
    """The server's /metrics as {sample: value}."""
    return parse_metrics(httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=30).text)


def test_json_schemas_batched_every_answer_validates(client):
    """24 requests at once (3 schemas x chat/completions x greedy/seeded x streamed or not): every answer ends
    "stop" and validates against its schema."""
    cases = [
        (schema, endpoint, sampling, stream)
        for schema in SCHEMAS
        for endpoint in ("chat", "completions")
        for sampling in SAMPLINGS
        for stream in (False, True)
    ]

    def run(case):
        schema, endpoint, sampling, stream = case
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": schema, "schema": SCHEMAS[schema], "strict": True},
        }
        options = SAMPLINGS[sampling] | {"max_tokens": 120, "response_format": response_format, "extra_body": TIGHT}
        return ask(client, endpoint, QUESTIONS[schema], stream, **options)

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(run, cases))
    for case, (text, finish_reason) in zip(cases, answers):
        assert finish_reason == "stop", (case, text)
        jsonschema.validate(json.loads(text), SCHEMAS[case[0]])


def test_json_object_json_regex_choice_and_grammar_fields(client):
    zip_code = r"[0-9]{5}"
    cases = {
        "json_object": (
            "chat",
            'Describe a cat as a JSON object like {"name": "Tom", "age": 3}.',
            {"response_format": {"type": "json_object"}, "extra_body": TIGHT},
        ),
        "regex": ("completions", "A zip code:", {"extra_body": {"structured_outputs": {"regex": zip_code}}}),
        "guided_regex": ("chat", "Give me a zip code.", {"extra_body": {"guided_regex": zip_code}}),
        "choice": ("chat", "Is the sky blue?", {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}),
        "guided_choice": ("completions", "The best pet:", {"extra_body": {"guided_choice": ["cat", "dog", "fish"]}}),
        "grammar": ("chat", "Name a color.", {"extra_body": {"structured_outputs": {"grammar": COLOR_GRAMMAR}}}),
        "guided_grammar": ("completions", "A color:", {"extra_body": {"guided_grammar": COLOR_GRAMMAR}}),
        "json": (
            "completions",
            QUESTIONS["colors"],
            {"extra_body": {"structured_outputs": {"json": COLORS} | TIGHT_KEY}},
        ),
        "guided_json": ("chat", QUESTIONS["mood"], {"extra_body": {"guided_json": MOOD} | TIGHT}),
    }

    def run(case):
        endpoint, question, options = case
        return ask(client, endpoint, question, False, temperature=0.8, seed=3, max_tokens=60, **options)

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = dict(zip(cases, pool.map(run, cases.values())))
    assert all(finish_reason == "stop" for _, finish_reason in answers.values()), answers
    assert isinstance(json.loads(answers["json_object"][0]), dict)
    assert re.fullmatch(zip_code, answers["regex"][0]) and re.fullmatch(zip_code, answers["guided_regex"][0])
    assert answers["choice"][0] in ("yes", "no") and answers["guided_choice"][0] in ("cat", "dog", "fish")
    assert answers["grammar"][0] in ("red", "green", "blue") and answers["guided_grammar"][0] in (
        "red",
        "green",
        "blue",
    )
    jsonschema.validate(json.loads(answers["json"][0]), COLORS)
    jsonschema.validate(json.loads(answers["guided_json"][0]), MOOD)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD}}
# name: (extra body, words of the message)
BAD = {
    "invalid schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "not a valid JSON schema",
    ),
    "invalid regex": ({"guided_regex": "(unclosed"}, "structured_outputs.regex does not compile"),
    "invalid grammar": ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
    "empty choice": ({"guided_choice": []}, "structured_outputs.choice must be a non-empty list"),
    "unknown response_format": ({"response_format": {"type": "yaml"}}, "response_format type must be"),
    "unknown structured_outputs key": ({"structured_outputs": {"xml": "<a/>"}}, "unknown keys ['xml']"),
    "two constraints": ({"response_format": SCHEMA_FORMAT, "guided_regex": "a+"}, "response_format and guided_regex"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("body, words", BAD.values(), ids=BAD.keys())
def test_a_bad_constraint_is_a_400_and_nothing_is_queued(client, endpoint, stream, body, words):
    looked_up = metrics(client)["rosellm:prefix_cache_queries_total"]  # grows with every prompt scheduled
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, endpoint, "hi", stream, max_tokens=8, extra_body=body)
    assert info.value.status_code == 400 and words in info.value.body["message"], info.value.body
    after = metrics(client)
    assert after["rosellm:prefix_cache_queries_total"] == looked_up
    assert after["rosellm:num_requests_running"] == after["rosellm:num_requests_waiting"] == 0


def test_the_server_serves_after_bad_constraints(client):
    with pytest.raises(openai.BadRequestError):
        ask(client, "chat", "hi", True, max_tokens=8, extra_body={"guided_regex": "(unclosed"})
    looked_up = metrics(client)["rosellm:prefix_cache_queries_total"]
    text, finish_reason = ask(client, "chat", "Say hello.", False, max_tokens=8, temperature=0)
    assert text and finish_reason in ("stop", "length")
    assert ask(client, "completions", "1, 2, 3,", False, max_tokens=4, response_format={"type": "text"})[0]
    assert metrics(client)["rosellm:prefix_cache_queries_total"] > looked_up  # the counter the 400 tests watch
