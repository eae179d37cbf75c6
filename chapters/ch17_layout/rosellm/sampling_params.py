"""What a request asks of its answer (vLLM's `SamplingParams`): how to pick each token, when to stop, and
what the answer must match (`StructuredOutputsParams`: a JSON schema, any JSON object, a regular expression,
one of a list of strings, or a grammar in EBNF). Plain data, checked here for shape; the sampler
(sample/sampler.py) and the grammars (structured_output/grammar.py) act on it."""

import json
import math
import numbers
from dataclasses import dataclass, fields

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint. `json`: a JSON schema (a dict, or its JSON text). `json_object=True`: any JSON
    object. `regex`: a regular expression the whole answer matches. `choice`: the answer is one of these
    strings. `grammar`: an EBNF grammar whose start rule is `root` (xgrammar's dialect).
    `disable_any_whitespace`: compact JSON, no whitespace between its tokens (vLLM's name; by default a model
    may put whitespace there, and a small model may put a lot of it). Bad values raise ValueError."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r:.80}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {self.choice!r:.80}")
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"structured_outputs.disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}"
            )

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """The constraint as a hashable value, equal for equal constraints: what compiled grammars are cached by."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, options: dict) -> "StructuredOutputsParams":
        """From a JSON body's dict (the server); unknown keys are a ValueError naming them."""
        if not isinstance(options, dict):
            raise ValueError(f"structured_outputs must be an object, got {options!r:.80}")
        unknown = set(options) - {field.name for field in fields(cls)}
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {sorted(unknown)}; known: {', '.join(KINDS)}")
        return cls(**options)


# Temperatures below this are greedy, as in vLLM: dividing logits by a tinier one overflows to inf.
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64  # what torch.Generator.manual_seed accepts: [0, 2**64)


@dataclass
class SamplingParams:
    """How to pick each next token. `temperature` below GREEDY_TEMPERATURE (e.g. 0) means greedy.
    `max_tokens=None`: until a stop token or `max_model_len`. `n`: answers sampled from the one prompt;
    with a seed, answer i draws from its own stream seeded `seed + i` (so answer i of a seeded request with
    n > 1 equals a request for one answer seeded `seed + i`). `stop`: strings that end an answer when its
    text contains one (engine/stop_strings.py; a str alone is one stop string). Bad values raise ValueError naming
    the limit. `structured_outputs`: a constraint the answer must match (`StructuredOutputsParams`, above)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no top-p filter
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] | str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self.temperature = real("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        self.top_p = real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = integer("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if integer("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= integer("seed", self.seed) <= MAX_SEED - self.n:
            raise ValueError(f"seed must be an integer in [0, 2**64 - n] (n={self.n} streams from it), got {self.seed}")
        stop = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop!r}")
        self.stop_token_ids = [integer("stop_token_ids", t) for t in stop]
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)
