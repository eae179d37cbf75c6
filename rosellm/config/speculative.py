"""Speculative decoding's options, as vLLM names them: `LLM(model, speculative_config={...})`.

method                  "ngram" (prompt lookup: propose what followed the sequence's last n tokens
                        earlier in its own context) or "draft_model" (a smaller or quantized model
                        proposes, sharing the target's vocabulary)
num_speculative_tokens  k: tokens proposed per sequence and step, verified by the target in one forward
prompt_lookup_min/max   n-gram: the shortest and longest suffix matched; vLLM's defaults (5 and 5 when
                        neither is given, the other one's value when one is)
model                   draft model: a .gguf file or a Hugging Face folder; None: the target's own model
disable_by_batch_size   speculation off in a step where at least this many sequences run (None: never): a
                        large batch is compute-bound, and verifying drafts there costs what it saves
quantization            draft model: its weights' quantization ("int4" by default: the target's own
                        weights in 4 bits make a draft that agrees with it most of the time)
adaptive_draft_length   each sequence asks for as many drafts as its last verify step earned, and waits
                        after drafts that were all rejected (spec_decode/draft_pace.py); False: k drafts
                        whenever the proposer finds them, as vLLM does
"""

from dataclasses import dataclass, fields

from ..sampling_params import integer

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_DRAFT_QUANTIZATION = "int4"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    quantization: str | None = DEFAULT_DRAFT_QUANTIZATION
    disable_by_batch_size: int | None = None
    adaptive_draft_length: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if integer("num_speculative_tokens", self.num_speculative_tokens) < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and integer("disable_by_batch_size", self.disable_by_batch_size) < 2:
            raise ValueError(f"disable_by_batch_size must be >= 2 or None, got {self.disable_by_batch_size}")
        if not isinstance(self.adaptive_draft_length, bool):
            raise ValueError(f"adaptive_draft_length must be True or False, got {self.adaptive_draft_length!r}")
        if self.method == "ngram":
            low = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
            high = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min
            low = DEFAULT_PROMPT_LOOKUP if low is None else integer("prompt_lookup_min", low)
            high = DEFAULT_PROMPT_LOOKUP if high is None else integer("prompt_lookup_max", high)
            if not 1 <= low <= high:
                raise ValueError(f"prompt_lookup_min and _max must satisfy 1 <= min <= max, got {low} and {high}")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_dict(cls, options) -> "SpeculativeConfig":
        """vLLM's dict; an unknown key, a missing method or k is a ValueError naming the known ones."""
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {options!r}")
        known = [field.name for field in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {', '.join(known)}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in options]
        if missing:
            raise ValueError(f"speculative_config needs {' and '.join(missing)}")
        return cls(**options)
