"""Command line: `python -m rosellm generate "question"` and `python -m rosellm demo`.

Options are checked before the model loads; a bad one ends the run with one line on stderr and exit code 2.
`--chapter NN` runs chapter NN's checkpoint instead of this package (it needs a clone of the repository).
"""

import argparse
import importlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from . import loader
from .chat_template import chat_prompt

T = TypeVar("T")

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences what a KV cache is.",
]


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit code 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, unless the default is "not given" (None or off)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def at_least(low, kind, inclusive=True):
    """An argparse type: a number of `kind` that is >= low (or > low when not inclusive)."""

    def parse(text: str):
        value = kind(text)
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        return value

    return parse


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="rosellm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,demo}")
    gen = sub.add_parser("generate", help="answer one prompt, streaming", formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt", help="the question (wrapped in the model's chat template unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    demo = sub.add_parser("demo", help="answer three questions, streaming", formatter_class=DefaultsHelpFormatter)
    for p in (gen, demo):
        p.add_argument(
            "--model",
            default=None,
            help=".gguf file or Hugging Face folder; default: the bundled SmolLM2-135M-Instruct",
        )
        p.add_argument("--max-tokens", type=at_least(1, int), default=128, help="most tokens to generate")
        p.add_argument("--temperature", type=at_least(0, float), default=0.0, help="sampling temperature; 0 is greedy")
        p.add_argument(
            "--top-p",
            type=probability,
            default=1.0,
            help="keep the most likely tokens up to this probability mass; 1 keeps all",
        )
        p.add_argument("--top-k", type=at_least(0, int), default=0, help="keep the k most likely tokens; 0 keeps all")
        p.add_argument("--seed", type=int, default=None, help="seed of the sampler; default: a fresh random stream")
        p.add_argument("--device", default="cpu", help='"cpu", "cuda" or "cuda:N"')
        p.add_argument(
            "--chapter",
            default=None,
            metavar="NN",
            help="run chapter NN's checkpoint (e.g. 03) instead of the latest engine",
        )
    return parser


# --- checks before loading ------------------------------------------------------------------------------


class BadOption(Exception):
    """An option that cannot work; reported as one line, exit code 2."""


def model_source(model: str | None) -> Path:
    """The model's file or folder, checked as the loader checks it."""
    try:
        return loader.model_source(model)
    except FileNotFoundError as error:
        raise BadOption(str(error) if model is None else f"--model {error}") from None


def check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise BadOption(f'--device {device}: expected "cpu", "cuda" or "cuda:N"') from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise BadOption(f"--device {device}: PyTorch sees no CUDA device here")
    if kind not in ("cpu", "cuda"):
        raise BadOption(f'--device {device}: rosellm runs on "cpu" or "cuda"')


def engine_package(args):
    """The package to run: this one, or the checkpoint `--chapter` names."""
    if args.chapter is None:
        return importlib.import_module(__package__)
    try:
        from chapters import checkpoint
    except ImportError:
        raise BadOption("--chapter needs a clone of the rosellm repository (run it from the clone's root)") from None
    try:
        chosen = checkpoint(args.chapter)
    except ValueError as error:
        raise BadOption(f"--chapter {args.chapter}: {error}") from None
    return chosen.load()


def engine_options(args) -> dict:
    """The options of `LLM` that the command line sets."""
    return {"device": args.device}


# --- loading, with word of the one slow first run ---------------------------------------------------------


def needs_conversion(source: Path) -> bool:
    """Whether loading `source` converts a GGUF file first: the loader caches the conversion."""
    return source.is_file() and not (loader.gguf_cache_folder(source) / "model.safetensors").is_file()


def load_llm(package, model: str | None, source: Path, options: dict):
    """`package.LLM(model, **options)`, telling stderr what takes time while it happens, each step timed apart:
    the conversion of a GGUF file (its first run only), then the load."""
    if needs_conversion(source):
        announced(
            f"converting {source.name} to a cached Hugging Face folder (first run only)",
            lambda: loader.resolve_model_folder(model),
        )
    return announced(f"loading {source.name} on {options['device']}", lambda: package.LLM(model, **options))


def announced(what: str, build: Callable[[], T]) -> T:
    """`build()`, with `what` on stderr meanwhile (and on a terminal the seconds it takes), then its time."""
    done = threading.Event()
    ticker = threading.Thread(target=show_elapsed, args=(what, done), daemon=True)
    ticker.start()
    start = time.perf_counter()
    try:
        return build()
    finally:
        done.set()
        ticker.join()
        again = f"\r{what} ..." if sys.stderr.isatty() else ""
        print(f"{again} done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def show_elapsed(what: str, done: threading.Event) -> None:
    """Print `what`, then on a terminal the seconds elapsed on the same line, until `done` is set."""
    start = time.perf_counter()
    print(f"{what} ...", end="", file=sys.stderr, flush=True)
    while not done.wait(1.0):
        if sys.stderr.isatty():
            print(f"\r{what} ... {time.perf_counter() - start:.0f} s", end="", file=sys.stderr, flush=True)


# --- generating ----------------------------------------------------------------------------------------


def timed_stream(stream) -> tuple[object, float, float]:
    """Print an `LLM.stream` as it arrives. Returns (final RequestOutput, seconds to the first text piece,
    seconds in all). The first piece comes after the prefill step that samples the first token."""
    start = time.perf_counter()
    first = None
    while True:
        try:
            piece = next(stream)
        except StopIteration as stop:
            print()
            end = time.perf_counter()
            return stop.value, (end if first is None else first) - start, end - start
        first = first or time.perf_counter()
        print(piece, end="", flush=True)


def timing_line(output, ttft: float, total: float) -> str:
    """Time to first token (prefill of the whole prompt, chat template included) and decode speed apart."""
    decoded, decode_seconds = len(output.token_ids) - 1, total - ttft
    rate = f"{decoded / decode_seconds:.1f} tokens/s" if decoded > 0 and decode_seconds > 0 else "n/a"
    return (
        f"[prefill {len(output.prompt_token_ids)} prompt tokens: time to first token {ttft * 1000:.0f} ms | "
        f"decode {decoded} tokens in {decode_seconds:.2f} s: {rate}]"
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        source = model_source(args.model)
        check_device(args.device)
        package = engine_package(args)
    except BadOption as error:
        parser.exit(2, f"rosellm {args.command}: error: {error}\n")
    try:
        llm = load_llm(package, args.model, source, engine_options(args))
        params = package.SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
        )
        questions = [args.prompt] if args.command == "generate" else DEMO_QUESTIONS
        raw = args.command == "generate" and args.raw
        for question in questions:
            if args.command == "demo":
                print(f"\n>>> {question}")
            prompt = question if raw else chat_prompt(llm.tokenizer, [{"role": "user", "content": question}])
            output, ttft, total = timed_stream(llm.stream(prompt, params))
            print(timing_line(output, ttft, total), file=sys.stderr)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"rosellm {args.command}: error: {error}\n")
    except KeyboardInterrupt:
        parser.exit(130, "\n")


if __name__ == "__main__":
    main()
