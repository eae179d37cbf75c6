"""What `generate` returns for each request."""

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated tokens, the stop token included
    text: str = ""  # generated text, special tokens skipped
    # "stop" (EOS or a stop token) | "length" (max_tokens or max_model_len) | None (not finished)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
