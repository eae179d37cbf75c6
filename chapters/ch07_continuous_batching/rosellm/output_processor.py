"""Outputs out: what the engine keeps per request beside its sequence to turn sampled tokens into text and
`RequestOutput` snapshots. Plain Python over tokens and text: it never touches the model."""

from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput
from .sequence import Sequence


@dataclass
class RequestState:
    """One request's record beside its `Sequence`: its random stream and the text released so far."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""

    def add_token(self, token: int, finish_reason: str | None) -> None:
        """The text of a token the sequence has just appended (all of it, once the request finished)."""
        self.text += self.detokenizer.add(token)
        if finish_reason is not None:
            self.text += self.detokenizer.flush()

    def output(self, finish_reason: str | None = None) -> RequestOutput:
        """A snapshot for the caller: later steps never change it."""
        seq = self.seq
        return RequestOutput(
            seq.request_id,
            self.prompt,
            list(seq.prompt_token_ids),
            list(seq.output_token_ids),
            self.text,
            finish_reason,
        )
