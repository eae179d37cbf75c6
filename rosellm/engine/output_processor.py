"""Outputs out: what the engine keeps per request beside its sequences to turn sampled tokens into text and
`RequestOutput` snapshots. Plain Python over tokens and text: it never touches the model."""

from dataclasses import dataclass

import torch
import xgrammar

from ..core.sequence import Sequence
from ..outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from ..spec_decode.draft_pace import DraftPace
from ..structured_output.grammar import GrammarState
from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher


@dataclass(frozen=True)
class SampleState:
    """What committing a step's tokens changes in one sample, saved so that a failed commit can put it back."""

    seq: Sequence | None
    num_output_tokens: int
    num_block_hashes: int
    detokenizer: tuple[int, int, int] | None
    stop_matcher: tuple[str, bool]
    num_grammar_tokens: int
    text: str
    finish_reason: str | None
    pace: DraftPace | None


@dataclass
class Sample:
    """One of a request's n answers: its sequence, its random stream, where it is in its grammar (with
    structured outputs), the text released so far and how many drafts it asks for (with speculation)."""

    seq: Sequence | None  # None until the prompt is computed and the request forks (sample 0 has it at once)
    detokenizer: IncrementalDetokenizer | None  # None: the caller turns tokens into text (no text here)
    generator: torch.Generator | None
    stop_matcher: StopStringMatcher
    grammar: GrammarState | None = None
    text: str = ""  # released text: a possible start of a stop string is held back by the matcher
    finish_reason: str | None = None
    pace: DraftPace | None = None  # None: k drafts whenever the proposer finds them

    def save(self) -> SampleState:
        seq = self.seq
        return SampleState(
            seq,
            0 if seq is None else len(seq.output_token_ids),
            0 if seq is None else len(seq.block_hashes),
            None if self.detokenizer is None else self.detokenizer.save(),
            self.stop_matcher.save(),
            0 if self.grammar is None else self.grammar.num_accepted,
            self.text,
            self.finish_reason,
            self.pace,
        )

    def restore(self, state: SampleState) -> None:
        """Back to `state`: the tokens appended since leave its sequence (and the hashes of blocks holding
        them), its detokenizer, its stop-string matcher and its grammar; a fork made since is undone."""
        self.seq = state.seq
        if self.seq is not None:
            del self.seq.output_token_ids[state.num_output_tokens :]
            del self.seq.block_hashes[state.num_block_hashes :]
        if self.detokenizer is not None:
            self.detokenizer.restore(state.detokenizer)
        self.stop_matcher.restore(state.stop_matcher)
        if self.grammar is not None:
            self.grammar.rollback_to(state.num_grammar_tokens)
        self.text, self.finish_reason, self.pace = state.text, state.finish_reason, state.pace


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
        pace: DraftPace | None = None,
    ) -> "RequestState":
        """A new request's record: its one sequence, and per sample (`generators` has one each) a detokenizer
        (none if `detokenize` is False: tokens only, no text and no stop strings), a random stream, a
        stop-string matcher, given a compiled `grammar` its own state in it, and the draft `pace` it starts
        from; counts of its drafts if `speculative`."""
        samples = [
            Sample(
                seq if index == 0 else None,
                IncrementalDetokenizer(tokenizer) if detokenize else None,
                generator,
                StopStringMatcher(seq.params.stop),
                None if grammar is None else GrammarState(grammar),
                pace=pace,
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

    def save(self) -> tuple[list[SampleState], SpecDecodeStats | None]:
        """Everything a step's commit may change in the request, for `restore`."""
        return [sample.save() for sample in self.samples], self.spec_decode

    def restore(self, saved: tuple[list[SampleState], SpecDecodeStats | None]) -> None:
        states, self.spec_decode = saved
        for sample, state in zip(self.samples, states):
            sample.restore(state)

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
