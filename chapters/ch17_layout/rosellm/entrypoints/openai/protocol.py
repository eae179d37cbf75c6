"""OpenAI's API as rosellm speaks it: request bodies checked and turned into a prompt and `SamplingParams`,
responses and stream chunks built from `RequestOutput`s, errors in OpenAI's JSON shape. No HTTP here.

Understood: `/v1/completions` with one prompt (a string or a list of token ids), `/v1/chat/completions` with
text messages; `model` (may be left out: the one served), `max_tokens` (chat: also `max_completion_tokens`,
which wins), `temperature`, `top_p`, `n`, `stop` (a string or a list), `seed`, `stream` and
`stream_options.include_usage`, `response_format` (`text`, `json_object`, `json_schema`); beyond OpenAI's names,
vLLM's `top_k`, `ignore_eos`, `structured_outputs` (json / regex / choice / grammar / json_object /
disable_any_whitespace) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: one
constraint per request, whichever field names it. Parameters that would
change the answer but are not implemented (logprobs, penalties, ...) are refused with 400 rather than silently
ignored; unknown fields are ignored.

Values are checked by `SamplingParams` and the engine (token ids by its `check_token_ids`): a bad one gets
their ValueError's message, which names the limit, and OpenAI's `param` is the field that message starts with.
"""

import json
from dataclasses import dataclass

from jinja2 import TemplateError

from ...outputs import CompletionOutput, RequestOutput
from ...sampling_params import KINDS, SamplingParams, StructuredOutputsParams
from .. import chat_template

# Accepted only with the value that means "off" (or null).
UNSUPPORTED = {
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "best_of": (1,),
    "tools": ([],),
}
ROLES = ("system", "developer", "user", "assistant", "tool")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class APIError(Exception):
    """An error a client receives as OpenAI's JSON, with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """What a completions or chat request asks the engine for."""

    model: str | None
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # a last stream chunk with the token counts


# --- requests ---------------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as error:  # bad JSON or bad UTF-8
        raise APIError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_completion_request(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:  # OpenAI's batch of prompts
            raise APIError(f"one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise APIError("prompt must be a string or a list of token ids", param="prompt")
    return GenerationRequest(body.get("model"), prompt, sampling_params(body, "max_tokens", 16), *stream_options(body))


def parse_chat_request(body: dict, tokenizer) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of messages", param="messages")
    prompt = chat_prompt(tokenizer, [chat_message(m) for m in messages])
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return GenerationRequest(
        body.get("model"), prompt, sampling_params(body, max_tokens_field, None), *stream_options(body)
    )


def chat_message(message) -> dict:
    """{"role", "content"} with the content as one string (text parts joined)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise APIError(f"each message must be an object with a role in {ROLES}, got {message!r}", param="messages")
    content = message.get("content") or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise APIError("message content must be a string or a list of text parts", param="messages")
    return {"role": message["role"], "content": content}


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """`chat_template.chat_prompt`, with a conversation the template refuses answered as a 400."""
    try:
        return chat_template.chat_prompt(tokenizer, messages)
    except TemplateError as error:  # a template may refuse some conversations (e.g. roles out of order)
        raise APIError(f"the chat template rejected the messages: {error}", param="messages") from None


def sampling_params(body: dict, max_tokens_field: str, default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams from the body's fields (null means the default); their ValueError becomes a 400."""
    for name, off in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in off:
            raise APIError(f"{name} is not supported by rosellm", param=name)
    values = {
        "max_tokens": field(body, max_tokens_field, default_max_tokens),
        "temperature": field(body, "temperature", 1.0),
        "top_p": field(body, "top_p", 1.0),
        "top_k": field(body, "top_k", 0),
        "n": field(body, "n", 1),
        "seed": field(body, "seed", None),
        "stop": field(body, "stop", None),
        "ignore_eos": field(body, "ignore_eos", False),
        "structured_outputs": structured_outputs(body),
    }
    try:
        return SamplingParams(**values)
    except ValueError as error:
        name = str(error).split()[0]
        raise APIError(str(error), param=max_tokens_field if name == "max_tokens" else name) from None


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The constraint the body asks for, from whichever field names it (None: none). Two fields naming a
    constraint are refused; vLLM's `structured_outputs` may add only `disable_any_whitespace` to another's."""
    options, askers = {}, []
    for name, given in constraint_options(body):
        if set(given) & set(KINDS):
            askers.append(name)
        options |= given
    if len(askers) > 1:
        raise APIError(f"{' and '.join(askers)} each ask for a constraint; send one", param=askers[1])
    if not options:
        return None
    try:
        return StructuredOutputsParams.from_dict(options)
    except ValueError as error:
        raise APIError(str(error), param=askers[0] if askers else "structured_outputs") from None


def constraint_options(body: dict) -> list[tuple[str, dict]]:
    """(field, `StructuredOutputsParams` keywords) for each constraint field the body sets."""
    found = []
    if body.get("response_format") is not None:
        found.append(("response_format", response_format_options(body["response_format"])))
    if body.get("structured_outputs") is not None:
        if not isinstance(body["structured_outputs"], dict):
            raise APIError("structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", body["structured_outputs"]))
    found += [(name, {kind: body[name]}) for name, kind in GUIDED.items() if body.get(name) is not None]
    return found


def response_format_options(response_format) -> dict:
    """OpenAI's `response_format` as `StructuredOutputsParams` keywords: {} for text."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise APIError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        return {"json": spec["schema"]}
    raise APIError(
        f"response_format type must be text, json_object or json_schema, got {response_format!r:.80}",
        param="response_format",
    )


def field(body: dict, name: str, default):
    value = body.get(name)
    return default if value is None else value


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream, options = field(body, "stream", False), field(body, "stream_options", {})
    if not isinstance(stream, bool):
        raise APIError(f"stream must be true or false, got {stream!r}", param="stream")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError('stream_options must be {"include_usage": true or false}', param="stream_options")
    return stream, stream and options.get("include_usage", False)


# --- responses --------------------------------------------------------------------------------------------


def usage(output: RequestOutput) -> dict:
    """Token counts: the prompt once, every answer's tokens, and the prompt tokens the prefix cache served."""
    completion_tokens = sum(len(answer.token_ids) for answer in output.outputs)
    return {
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(output.prompt_token_ids) + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


class ResponseBuilder:
    """The response to one request, whole or as stream chunks: completions' "text_completion" objects or
    chat's "chat.completion" and "chat.completion.chunk" ones."""

    def __init__(self, request_id: str, model: str, created: int, chat: bool, include_usage: bool = False):
        self.request_id, self.model, self.created = request_id, model, created
        self.chat, self.include_usage = chat, include_usage
        self.sent: dict[int, int] = {}  # stream: characters of each answer already sent
        self.done: set[int] = set()  # stream: answers whose finish reason was sent

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        head = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def response(self, output: RequestOutput) -> dict:
        """The whole answer of a finished request."""
        choices = [self._choice(answer, answer.text, whole=True) for answer in output.outputs]
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage=usage(output))

    def chunks(self, output: RequestOutput) -> list[dict]:
        """Stream chunks for what is new in `output` since the last call: one per answer with new text or
        a finish reason."""
        chunks = []
        for answer in output.outputs:
            new_text = answer.text[self.sent.get(answer.index, 0) :]
            if answer.index in self.done or not (new_text or answer.finished or answer.index not in self.sent):
                continue
            chunk = self._choice(answer, new_text, whole=False, first=answer.index not in self.sent)
            self.sent[answer.index] = len(answer.text)
            if answer.finished:
                self.done.add(answer.index)
            chunks.append(self._chunk([chunk], **({"usage": None} if self.include_usage else {})))
        return chunks

    def usage_chunk(self, output: RequestOutput) -> dict:
        """The last chunk when `stream_options.include_usage`: no choices, the token counts."""
        return self._chunk([], usage=usage(output))

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", choices, **extra)

    def _choice(self, answer: CompletionOutput, text: str, whole: bool, first: bool = False) -> dict:
        choice = {"index": answer.index, "logprobs": None, "finish_reason": answer.finish_reason}
        if not self.chat:
            return {"index": answer.index, "text": text} | choice
        if whole:
            return {"index": answer.index, "message": {"role": "assistant", "content": text}} | choice
        delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
        return {"index": answer.index, "delta": delta} | choice
