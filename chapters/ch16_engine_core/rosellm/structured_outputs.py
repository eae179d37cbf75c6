"""What a request may ask its answer to match (vLLM's `StructuredOutputsParams`): a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a grammar in EBNF. Plain data, checked here for
shape; grammar.py compiles it into the token automaton that constrains decoding."""

import json
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
