"""Command line: `python -m rosellm generate "question"`, `python -m rosellm demo` and `python -m rosellm serve`.

Options are checked before the model loads; a bad one ends the run with one line on stderr and exit code 2.
`--chapter NN` runs chapter NN's checkpoint instead of this package (it needs a clone of the repository).
"""

import argparse
import importlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ..attention import selector
from ..config.engine import QUANTIZATIONS
from ..config.speculative import SpeculativeConfig
from ..model_executor.model_loader import loader
from ..model_executor.model_loader.quantization import check_options
from ..spec_decode.proposers import check_draft_model
from .chat_template import chat_prompt

T = TypeVar("T")
PACKAGE = __package__.rpartition(".")[0]  # rosellm, or a chapter's copy of it
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


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config: vLLM's dict as JSON, checked as the engine checks it."""
    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text}") from None
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="rosellm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,demo,serve}")
    gen = sub.add_parser("generate", help="answer one prompt, streaming", formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt", help="the question (wrapped in the model's chat template unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    demo = sub.add_parser("demo", help="answer three questions, streaming", formatter_class=DefaultsHelpFormatter)
    serve = sub.add_parser(
        "serve",
        help="serve OpenAI's API over HTTP (chapter 10), the engine in processes of its own (chapter 16)",
        description="Serve OpenAI's /v1/completions and /v1/chat/completions over HTTP. A request may constrain its "
        "answer (chapter 15) with OpenAI's response_format (json_object, json_schema) or vLLM's structured_outputs "
        "(json, regex, choice, grammar) and guided_json / guided_regex / guided_choice / guided_grammar.",
        formatter_class=DefaultsHelpFormatter,
    )
    for p in (gen, demo, serve):
        p.add_argument(
            "--model",
            default=None,
            help=".gguf file or Hugging Face folder; default: the bundled SmolLM2-135M-Instruct",
        )
        p.add_argument("--device", default="cpu", help='"cpu", "cuda" or "cuda:N"')
        p.add_argument(
            "--attention-backend",
            choices=selector.BACKENDS,
            default=None,
            help='attention kernels (from chapter 06); default: "triton" on CUDA, "cpu" elsewhere (chapter 11; '
            'before it, and with --enforce-eager, "torch")',
        )
        p.add_argument(
            "--enforce-eager",
            action="store_true",
            help="never torch.compile (from chapter 11): starts in seconds, runs slower",
        )
        p.add_argument(
            "--tensor-parallel-size",
            type=at_least(1, int),
            default=1,
            help="processes that split each layer between them (from chapter 12)",
        )
        p.add_argument(
            "--quantization",
            choices=QUANTIZATIONS,
            default=None,
            help="weights in fewer bytes (from chapter 13): gguf runs a .gguf file's own quantized tensors, "
            "int8 / int4 quantize the weights at load; default: fp32 weights",
        )
        p.add_argument(
            "--dtype",
            choices=("auto", "float32", "bfloat16"),
            default="auto",
            help="compute dtype (from chapter 13); auto: bfloat16 with --quantization on a CPU with native "
            "bf16, else float32 (bfloat16 on CUDA)",
        )
        p.add_argument(
            "--no-int8-activations",
            action="store_true",
            help="with --quantization on float32 compute, multiply the dequantized weights exactly instead of "
            "8-bit activations in integer dot products at few rows (from chapter 18)",
        )
        p.add_argument(
            "--speculative-config",
            type=speculative_config,
            default=None,
            metavar="JSON",
            help='speculative decoding (from chapter 14), vLLM\'s dict, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", "num_speculative_tokens": 3}\' '
            "(the model's own weights in int4 propose)",
        )
    for p in (gen, demo):
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
        p.add_argument(
            "--chapter",
            default=None,
            metavar="NN",
            help="run chapter NN's checkpoint (e.g. 03) instead of the latest engine",
        )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=port_number, default=8000, help="port to listen on; 0 picks a free one")
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API; default: its file or folder name"
    )
    serve.add_argument("--max-num-seqs", type=at_least(1, int), default=32, help="most sequences running at once")
    serve.add_argument(
        "--data-parallel-size",
        type=at_least(1, int),
        default=1,
        help="engine cores, each a process with a full copy of the model and its own KV pool, sharing the CPU "
        "threads; a new request goes to the least loaded (chapter 16)",
    )
    serve.add_argument(
        "--in-process",
        action="store_true",
        help="run the engine in the server's own process, driven by a thread (chapter 10), instead of in "
        "engine-core processes",
    )
    serve.add_argument(
        "--max-model-len", type=at_least(2, int), default=None, help="longest prompt + answer; default: the context"
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


def check_attention_backend(name: str | None, device: str) -> None:
    """The "triton" backend's own check (Triton installed; CUDA, or Triton's interpreter), before loading."""
    if name == "triton":
        try:
            selector.check_triton_runs(torch.device(device))
        except ValueError as error:
            raise BadOption(f"--attention-backend triton: {error}") from None


def check_quantization(args) -> None:
    """--quantization and --dtype, checked as the engine checks them (the model's header only is read)."""
    if args.quantization is not None and args.tensor_parallel_size > 1:
        raise BadOption("--quantization: quantized layers run in one process (not with --tensor-parallel-size)")
    try:
        check_options(args.model, args.device, args.dtype, args.quantization)
    except ValueError as error:
        option = "--quantization" if args.quantization else "--dtype"
        raise BadOption(f"{option} {args.quantization or args.dtype}: {error}") from None
    if args.speculative_config is not None:
        try:
            check_draft_model(args.model, args.device, args.speculative_config)
        except ValueError as error:
            raise BadOption(f"--speculative-config: {error}") from None


def engine_package(args):
    """The package to run: this one, or the checkpoint `--chapter` names."""
    if args.chapter is None:
        return importlib.import_module(PACKAGE)
    try:
        from chapters import checkpoint
    except ImportError:
        raise BadOption("--chapter needs a clone of the rosellm repository (run it from the clone's root)") from None
    try:
        chosen = checkpoint(args.chapter)
    except ValueError as error:
        raise BadOption(f"--chapter {args.chapter}: {error}") from None
    if args.enforce_eager and "compiled" not in chosen.capabilities:
        raise BadOption(
            f"--enforce-eager: chapter {chosen.number:02d} compiles nothing (compilation arrives in chapter 11)"
        )
    if args.tensor_parallel_size > 1 and "tensor_parallel" not in chosen.capabilities:
        raise BadOption(
            f"--tensor-parallel-size: chapter {chosen.number:02d} runs in one process "
            "(tensor parallelism arrives in chapter 12)"
        )
    if (args.quantization is not None or args.dtype != "auto") and "quantization" not in chosen.capabilities:
        raise BadOption(
            f"--quantization, --dtype: chapter {chosen.number:02d} has neither (quantization arrives in chapter 13)"
        )
    if args.no_int8_activations and "integer_dot" not in chosen.capabilities:
        raise BadOption(
            f"--no-int8-activations: chapter {chosen.number:02d} multiplies exactly (integer dot products arrive "
            "in chapter 18)"
        )
    if args.speculative_config is not None and "speculative_decoding" not in chosen.capabilities:
        raise BadOption(
            f"--speculative-config: chapter {chosen.number:02d} has no speculative decoding (it arrives in chapter 14)"
        )
    if args.attention_backend is not None and "triton_kernels" not in chosen.capabilities:
        raise BadOption(
            f"--attention-backend: chapter {chosen.number:02d} has a single attention path "
            "(backends arrive in chapter 06)"
        )
    return chosen.load()


def engine_options(args) -> dict:
    """The options of `LLM` that the command line sets."""
    options = {"device": args.device}
    if args.attention_backend is not None:
        options["attention_backend"] = args.attention_backend
    if args.enforce_eager:
        options["enforce_eager"] = True
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.quantization is not None:
        options["quantization"] = args.quantization
    if args.dtype != "auto":
        options["dtype"] = args.dtype
    if args.no_int8_activations:
        options["int8_activations"] = False
    if args.speculative_config is not None:
        options["speculative_config"] = args.speculative_config
    return options


# --- loading, with word of the one slow first run ---------------------------------------------------------


def needs_conversion(source: Path, quantization: str | None = None) -> bool:
    """Whether loading `source` converts a GGUF file first (the loader caches the conversion); a GGUF file
    run as it is (--quantization gguf) is never converted."""
    converted = (loader.gguf_cache_folder(source) / "model.safetensors").is_file()
    return source.is_file() and not converted and quantization != "gguf"


def load_llm(package, model: str | None, source: Path, options: dict):
    """`package.LLM(model, **options)`, telling stderr what takes time while it happens, each step timed apart:
    the conversion of a GGUF file (its first run only), then the load."""
    convert_first(model, source, options)
    return announced(loading_what(source, options), lambda: package.LLM(model, **options))


def convert_first(model: str | None, source: Path, options: dict) -> None:
    """Convert a GGUF file into the loader's cache now, timed on its own, if loading it would."""
    if needs_conversion(source, options.get("quantization")):
        announced(
            f"converting {source.name} to a cached Hugging Face folder (first run only)",
            lambda: loader.resolve_model_folder(model),
        )


def loading_what(source: Path, options: dict) -> str:
    return f"loading {source.name} on {options['device']}"


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


# --- serving (chapter 10) --------------------------------------------------------------------------------


def default_model_name(model: str | None) -> str:
    """What the API calls the model unless --served-model-name says: the file's stem or the folder's name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def serve(parser: argparse.ArgumentParser, args) -> None:
    """`rosellm serve`: listen on the port (a taken port fails before the model loads), load, serve until Ctrl-C."""
    from .openai import api_server  # FastAPI and uvicorn load only to serve

    try:
        source = model_source(args.model)
        check_device(args.device)
        check_attention_backend(args.attention_backend, args.device)
        check_quantization(args)
        if args.in_process and args.data_parallel_size > 1:
            raise BadOption("--data-parallel-size: replicas are engine-core processes (not with --in-process)")
        try:
            sock = api_server.listening_socket(args.host, args.port)
        except OSError as error:
            raise BadOption(f"cannot listen on {args.host}:{args.port}: {error}") from None
    except BadOption as error:
        parser.exit(2, f"rosellm serve: error: {error}\n")
    options = engine_options(args) | {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    try:
        with sock:
            engine = start_engine(args, source, options)
            name = args.served_model_name or default_model_name(args.model)
            host, port = sock.getsockname()[:2]
            print(f"serving {name} at http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
            api_server.serve(engine, sock, name)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"rosellm serve: error: {error}\n")
    except KeyboardInterrupt:
        parser.exit(130, "\n")


def start_engine(args, source: Path, options: dict):
    """The server's engine: engine-core processes behind a front end (chapter 16), or with --in-process one
    engine driven by a thread of the server's own process (chapter 10)."""
    from ..engine.async_llm import AsyncLLM
    from ..engine.async_llm_engine import AsyncLLMEngine

    if args.in_process:
        return AsyncLLMEngine(load_llm(importlib.import_module(PACKAGE), args.model, source, options).llm_engine)
    cores = args.data_parallel_size
    convert_first(args.model, source, options)  # once, here, not in each core
    what = f"{loading_what(source, options)}, in {cores} engine-core process{'es' if cores > 1 else ''}"
    return announced(what, lambda: AsyncLLM(args.model, data_parallel_size=cores, **options))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(parser, args)
    try:
        source = model_source(args.model)
        check_device(args.device)
        check_attention_backend(args.attention_backend, args.device)
        package = engine_package(args)
        check_quantization(args)
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
