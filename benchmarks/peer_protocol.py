"""The protocol every peer's script speaks: `PYTHON peer_X.py SPEC OUT` in the peer's own virtual environment.

SPEC (JSON): model (the weights this peer reads), threads, options, requests and warmup (lists of [prompt token ids,
max_tokens], a peer's own sampling fields third where it takes them), reference: {request index: transformers'
greedy tokens}, dtype and must_match. OUT (JSON): engine, version, settings, load_s, check_tokens ({request index:
the peer's tokens}) and, only when those equal the reference or must_match is false, the timed run: wall_s,
first_token_s, last_token_s and tokens per request.
Standard library only: the peers' environments have neither torch nor rosellm. `benchmarks.engines` times rosellm
and transformers with the same `Clock`.
"""

import json
import sys
import time
from pathlib import Path


def serve(load, generate) -> None:
    """`load(spec)` -> (engine, {"engine", "version", "settings"}); `generate(engine, requests)` -> {"wall_s",
    "first_token_s", "last_token_s", "tokens"}, every request greedy, EOS ignored unless its sampling fields say
    otherwise, all submitted at t = 0. An engine that fails to load writes {"error": its message} instead."""
    spec_path, out_path = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    try:
        engine, result = load(spec)
    except Exception as error:  # a setting the engine refuses: its own words go in the result
        Path(out_path).write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return
    result["load_s"] = round(time.perf_counter() - start, 2)
    keys = list(spec["reference"])
    sample = [[r[0], len(spec["reference"][k]), *r[2:]] for k in keys for r in [spec["requests"][int(k)]]]
    result["check_tokens"] = dict(zip(keys, generate(engine, sample)["tokens"]))
    if result["check_tokens"] == spec["reference"] or not spec.get("must_match", True):
        generate(engine, spec["warmup"])
        result.update(generate(engine, spec["requests"]))
    else:
        result["skipped"] = "greedy tokens differ from transformers' on the checked sample: not timed"
    Path(out_path).write_text(json.dumps(result))


class Clock:
    """Each request's first and last token times and its tokens, from t = 0 (the object's creation)."""

    def __init__(self, count: int):
        self.start = time.perf_counter()
        self.first, self.last, self.tokens = [None] * count, [None] * count, [None] * count

    def token(self, i: int, tokens: list[int] | None = None) -> None:
        """Request i got a token; `tokens` is all of them when it finished."""
        now = time.perf_counter() - self.start
        self.first[i] = now if self.first[i] is None else self.first[i]
        if tokens is not None:
            self.last[i], self.tokens[i] = now, list(tokens)

    def result(self) -> dict:
        return {"wall_s": max(self.last), "first_token_s": self.first, "last_token_s": self.last, "tokens": self.tokens}
