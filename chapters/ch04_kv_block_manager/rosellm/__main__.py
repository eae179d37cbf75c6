"""Command line: `python -m rosellm generate "question"` and `python -m rosellm demo`."""

import argparse
import sys
import time

from . import LLM, RequestOutput, SamplingParams

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences what a KV cache is.",
]


def chat_prompt(llm: LLM, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def print_stream(stream) -> RequestOutput:
    """Print an `LLM.stream` as it arrives; return its final output."""
    while True:
        try:
            print(next(stream), end="", flush=True)
        except StopIteration as stop:
            print()
            return stop.value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rosellm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt, streaming")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    demo = sub.add_parser("demo", help="answer three questions, streaming")
    for p in (gen, demo):
        p.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: SmolLM2)")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    llm = LLM(model=args.model)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.command == "generate":
        questions, raw = [args.prompt], args.raw
    else:
        questions, raw = DEMO_QUESTIONS, False
    total_tokens, total_seconds = 0, 0.0
    for question in questions:
        if args.command == "demo":
            print(f"\n>>> {question}")
        prompt = question if raw else chat_prompt(llm, question)
        start = time.perf_counter()
        output = print_stream(llm.stream(prompt, params))
        total_seconds += time.perf_counter() - start
        total_tokens += len(output.token_ids)
    print(
        f"\n[{total_tokens} tokens in {total_seconds:.2f} s: {total_tokens / total_seconds:.1f} tokens/s]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
