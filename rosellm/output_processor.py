"""Outputs out: what the engine keeps per request beside its sequences to turn sampled tokens into text and
`RequestOutput` snapshots. Plain Python over tokens and text: it never touches the model."""

from dataclasses import dataclass

import torch
import xgrammar

from .detokenizer import IncrementalDetokenizer
from .grammar import GrammarState
from .outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from .sequence import Sequence
from .stop_strings import StopStringMatcher


@dataclass
class Sample:
    """One of a request's n answers: its sequence, its random stream, where it is in its grammar (with
    structured outputs) and the text released so far."""

    seq: Sequence | None  # None until the prompt is computed and the request forks (sample 0 has it at once)
    detokenizer: IncrementalDetokenizer | None  # None: the caller turns tokens into text (no text here)
    generator: torch.Generator | None
    stop_matcher: StopStringMatcher
    grammar: GrammarState | None = None
    text: str = ""  # released text: a possible start of a stop string is held back by the matcher
    finish_reason: str | None = None


@dataclass
class RequestState:
    """One request's record: its prompt and one `Sample` per answer (`seq.index` is the sample's place)."""

    prompt: str | None
    samples: list[Sample]
    spec_decode: SpecDecodeStats | None = None  # its drafts, proposed and accepted (with speculative decoding)

    @classmethod
    def start(
        cls,
        prompt: str | None,
        seq: Sequence,
        tokenizer,
        generators: list,
        speculative: bool = False,
        grammar: xgrammar.CompiledGrammar | None = None,
        detokenize: bool = True,
    ) -> "RequestState":
        """A new request's record: its one sequence, and per sample (`generators` has one each) a detokenizer
        (none if `detokenize` is False: tokens only, no text and no stop strings), a random stream, a
        stop-string matcher and, given a compiled `grammar`, its own state in it; counts of its drafts if
        `speculative`."""
        samples = [
            Sample(
                seq if index == 0 else None,
                IncrementalDetokenizer(tokenizer) if detokenize else None,
                generator,
                StopStringMatcher(seq.params.stop),
                None if grammar is None else GrammarState(grammar),
            )
            for index, generator in enumerate(generators)
        ]
        return cls(prompt, samples, SpecDecodeStats() if speculative else None)

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences that run: the first alone until the prompt is computed, then one per sample."""
        return [sample.seq for sample in self.samples if sample.seq is not None]

    @property
    def finished(self) -> bool:
        return all(sample.finish_reason is not None for sample in self.samples)

    def add_token(self, index: int, token: int, finish_reason: str | None) -> str | None:
        """The text of a token sample `index`'s sequence has just appended; returns its finish reason,
        "stop" if the token completed a stop string."""
        sample = self.samples[index]
        if sample.grammar is not None:
            sample.grammar.accept(token)
        if sample.detokenizer is None:
            sample.finish_reason = finish_reason
            return finish_reason
        sample.text += released_text(sample.detokenizer, sample.stop_matcher, token, finish_reason is not None)
        if sample.stop_matcher.stopped:
            finish_reason = "stop"
        sample.finish_reason = finish_reason
        return finish_reason

    def output(self) -> RequestOutput:
        """A snapshot for the caller: later steps never change it."""
        first = self.samples[0].seq
        completions = [
            CompletionOutput(seq.index, list(seq.output_token_ids), sample.text, sample.finish_reason)
            for sample in self.samples
            if (seq := sample.seq) is not None
        ]
        return RequestOutput(
            first.request_id,
            self.prompt,
            list(first.prompt_token_ids),
            completions,
            first.num_cached_tokens or 0,
            self.spec_decode,
        )


def released_text(detokenizer: IncrementalDetokenizer, stop_matcher: StopStringMatcher, token: int, final: bool) -> str:
    """The text `token` releases: its detokenized piece (and all that was held back, if the answer ends with
    it: `final`), less what the stop-string matcher holds back or drops."""
    piece = detokenizer.add(token)
    if final:
        piece += detokenizer.flush()
    return stop_matcher.add(piece, final=final)
