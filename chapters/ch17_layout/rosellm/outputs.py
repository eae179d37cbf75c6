"""What `generate` returns for each request: one `CompletionOutput` per sampled answer."""

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One answer of a request (`SamplingParams.n` of them)."""

    index: int  # which answer: 0 .. n-1
    token_ids: list[int]  # generated tokens, the stop token included
    text: str = ""  # generated text, special tokens skipped, ending before a stop string
    # "stop" (EOS, a stop token or a stop string) | "length" (max_tokens or max_model_len) | None (not finished)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding's counts, for one request or the whole engine (vLLM's names)."""

    num_drafts: int = 0  # verify steps that checked at least one proposed token
    num_draft_tokens: int = 0  # proposed tokens the target checked
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: the target's own token, and the drafts it accepted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def __add__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        return SpecDecodeStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )


@dataclass
class RequestOutput:
    """A request's answers so far. `token_ids`, `text` and `finish_reason` are those of the first answer."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    spec_decode: SpecDecodeStats | None = None  # all answers' drafts together; None without speculation

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def finished(self) -> bool:
        """Every answer is finished."""
        return all(output.finished for output in self.outputs)
