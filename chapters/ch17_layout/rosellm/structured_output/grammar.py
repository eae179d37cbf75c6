"""Constraints compiled into token automata (xgrammar: Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"), and the automaton state of one answer.

A JSON schema, a regex or a choice list is first rewritten as a context-free grammar; xgrammar then works
out, for every state of that grammar's pushdown automaton, which tokens of this tokenizer may come next,
including tokens whose bytes straddle several grammar symbols (`"}` or `,"`). A `GrammarState` walks the
automaton one committed token at a time and writes the tokens allowed next as a bitmask: one bit per token,
32 to an int32 word (token_bitmask.py turns it into a mask on the logits).

Compiling costs milliseconds for a small schema and seconds for a large one; each distinct constraint is
compiled once per engine, when the first request asking for it is added (never inside a step), and kept in
`GrammarCache`. The cache is safe from several threads: the server compiles in a worker thread.
"""

import json
import re
import threading
from concurrent.futures import Executor, Future

import torch
import xgrammar

from ..sampling_params import StructuredOutputsParams
from ..spec_decode.proposer import Draft
from .token_bitmask import apply_bitmask

# xgrammar (0.2.8) spells a character of a string with minLength or maxLength as this class, which lets raw
# control characters through; JSON forbids them unescaped, so such strings get the class of its other strings.
BOUNDED_STRING_CHARACTER = r"[^\"\\\r\n]"
JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"
# xgrammar's errors start with a timestamp and a C++ source location; the reader wants the rest.
XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarCache:
    """Compiles constraints for one tokenizer, each distinct one once. The tokenizer's vocabulary is
    analysed (which bytes each token spells) at the first constrained request, not before."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._grammars: dict[tuple, xgrammar.CompiledGrammar] = {}
        self._lock = threading.Lock()  # guards the fields; compiling itself runs outside it
        self.num_compiled = self.num_hits = 0

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The automaton of `params`, compiled now or found in the cache. ValueError naming the problem for
        a schema, regex or grammar that does not compile."""
        key = params.key
        with self._lock:
            if key in self._grammars:
                self.num_hits += 1
                return self._grammars[key]
        if params.json is not None:
            check_json_schema(params.json)
        try:
            grammar = self._compile(params)
        except RuntimeError as error:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {xgrammar_message(error)}") from None
        with self._lock:
            self.num_compiled += 1
            return self._grammars.setdefault(key, grammar)  # a thread that compiled it meanwhile wins

    def compile_off_thread(self, params: StructuredOutputsParams, executor: Executor) -> Future:
        """`compile` on a thread of `executor`, as both serving engines do before they queue a constrained
        request: a large schema takes seconds, which the thread running the steps must not spend. The
        future's exception is `compile`'s ValueError."""
        return executor.submit(self.compile, params)

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self.compiler
        any_whitespace = not params.disable_any_whitespace
        separators = None if any_whitespace else (",", ":")  # without optional whitespace: compact, as vLLM's
        if params.json is not None:
            grammar = xgrammar.Grammar.from_json_schema(
                json.dumps(params.json), any_whitespace=any_whitespace, separators=separators
            )
            return compiler.compile_grammar(str(grammar).replace(BOUNDED_STRING_CHARACTER, JSON_STRING_CHARACTER))
        if params.json_object:  # an object, as OpenAI's json_object mode promises (not any JSON value)
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace, separators=separators
            )
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)

    @property
    def compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # xgrammar's own cache is off: this class's dict is the one cache, and what it counts is true.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`: root ::= "a" | "b" | ... (JSON's string
    escapes are also EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def check_json_schema(schema) -> None:
    """ValueError naming the first problem, unless `schema` is a valid JSON schema (its own metaschema's
    check: a wrong type name, a negative maxLength...)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.path) or "the top level"
        raise ValueError(f"structured_outputs.json is not a valid JSON schema at {where}: {error.message}") from None


def xgrammar_message(error: Exception) -> str:
    return XGRAMMAR_ERROR_PREFIX.sub("", str(error).strip())


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32, every bit set: every token allowed."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarState:
    """Where one answer is in its grammar's automaton. It moves only with committed tokens (`accept`), so a
    step that fails before its commit, and a preemption (which keeps the generated tokens), leave it right as
    it is; a commit that fails steps it back (`rollback_to`); looking ahead through drafts
    (`fill_draft_masks`) steps back before it returns."""

    def __init__(self, grammar: xgrammar.CompiledGrammar):
        self.matcher = xgrammar.GrammarMatcher(grammar)
        self.num_accepted = 0  # committed tokens it moved past

    @property
    def finished(self) -> bool:
        """The answer has ended the grammar with a stop token: nothing constrains the tokens after it (they
        come only with `ignore_eos`)."""
        return self.matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens that may come next (a stop token only where the grammar may
        end); left all-allowed once finished."""
        if not self.finished:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Move past a committed token. The mask allowed it, so a refusal is a bug in the engine."""
        if self.finished:
            return
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} was committed where the grammar does not allow it")
        self.num_accepted += 1

    def rollback_to(self, num_accepted: int) -> None:
        """Back to where it stood after its first `num_accepted` committed tokens."""
        self.matcher.rollback(self.num_accepted - num_accepted)
        self.num_accepted = num_accepted

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (drafts) the grammar allows in a row from here; the state is unchanged."""
        accepted = 0
        for token in token_ids:
            if self.finished or not self.matcher.accept_token(token):
                break
            accepted += 1
        self.matcher.rollback(accepted)
        return accepted

    def fill_draft_masks(self, bitmask: torch.Tensor, draft_token_ids: list[int]) -> None:
        """Rows 0 .. k of `bitmask` [k + 1, words] for a row verifying k drafts: row i is what may follow
        drafts 0 .. i-1. Rows after a draft the grammar refuses are left all-allowed: verification rejects
        that draft (its probability is 0), so nothing after it is used. The state is unchanged."""
        accepted = 0
        for i, token in enumerate(draft_token_ids):
            self.fill_mask(bitmask, i)
            if self.finished or not self.matcher.accept_token(token):
                break
            accepted += 1
        else:
            self.fill_mask(bitmask, len(draft_token_ids))
        self.matcher.rollback(accepted)


def grammar_checked(grammar: GrammarState | None, draft: Draft) -> Draft:
    """The part of `draft` worth verifying under `grammar` (all of it when unconstrained or all allowed).

    A draft proposed deterministically ends before its first token the grammar refuses: that token cannot be
    kept, so it is not worth a place in the forward. A sampled draft keeps that token (and ends after it): the
    masked target gives it probability 0, so the rejection rule refuses it for certain and draws the position
    from max(0, p - q) normalised. Ending before it would draw that position from p itself, and a token the
    draft also likes would come out too often (p = (.5, .5, 0) and q = (.5, 0, .5) over {a, b, c} with c
    refused: a must come with probability .5, and would with .75)."""
    if grammar is None:
        return draft
    valid = grammar.valid_prefix(draft.token_ids)
    if valid == len(draft.token_ids):
        return draft
    if draft.probs is None:
        return Draft(draft.token_ids[:valid])
    return Draft(draft.token_ids[: valid + 1], draft.probs[: valid + 1])


def mask_logits(logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
    """In place: logits [n, vocab], with one grammar state (or None: unconstrained) per row; each constrained
    row keeps only the tokens its grammar allows next. Unconstrained rows are not touched."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None and not grammar.finished]
    if rows:
        bitmask = allocate_bitmask(len(rows), logits.shape[-1])  # [constrained rows, words]
        for slot, row in enumerate(rows):
            grammars[row].fill_mask(bitmask, slot)
        apply_bitmask(logits, rows, bitmask)


def mask_draft_logits(logits: torch.Tensor, grammar: GrammarState, draft_token_ids: list[int]) -> None:
    """In place: logits [k + 1, vocab] of a row verifying k drafts, each position masked by what the grammar
    allows after the drafts before it (`GrammarState.fill_draft_masks`)."""
    bitmask = allocate_bitmask(len(draft_token_ids) + 1, logits.shape[-1])  # [k + 1, words]
    grammar.fill_draft_masks(bitmask, draft_token_ids)
    apply_bitmask(logits, list(range(len(draft_token_ids) + 1)), bitmask)
