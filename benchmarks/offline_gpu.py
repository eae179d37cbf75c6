"""offline-gpu (DESIGN.md §6): nano-vllm's throughput workload on a GPU, rosellm against transformers.

256 sequences of random token ids, input and output lengths uniform in [100, 1024], EOS ignored, on a
~0.6 B Llama-shaped model with random weights (Qwen3-0.6B's shape as a `LlamaConfig`: 28 layers, hidden
1024, 16 query heads and 8 KV heads of 128, MLP 3072, vocabulary 151936, tied embeddings) in bf16, written
to a temporary Hugging Face folder. nano-vllm samples at temperature 0.6; greedy decoding is used here so
that the engines' tokens can be compared (the sampler's cost is the same either way).

Engines, each in a process of its own: rosellm (chapter 06's Triton kernels, chapter 07's continuous
batching), transformers `generate` in static batches, transformers continuous batching. Where no CUDA
device exists it says so and exits (status 0) without writing a result.

    python -m benchmarks offline-gpu
"""

import datetime
import time
import sys
import tempfile
from pathlib import Path

from . import harness
from .machine import command_line
from .offline_cpu import (LABELS, agreement, kv_blocks_needed, output_paths, report, summarize_runs, targets_met,
                          workload_work)

NAME = "offline-gpu"
HELP = "DESIGN §6 offline-gpu: nano-vllm's workload (256 seqs, ~0.6B random Llama, bf16) vs transformers; CUDA only"
CHAPTER = 7  # measures chapter 07's step engine (`LLMEngine`)

QWEN3_0_6B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
NO_CUDA = ("offline-gpu: no CUDA device here (torch.cuda.is_available() is False); this workload runs only on a "
           "GPU. Nothing was measured and no result was written.")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face folder (default: a random ~0.6B Llama written to a temporary folder)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--static-batch", type=int, default=64, help="batch size of transformers generate")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="rosellm's KV pool (default: what all requests need at once)")
    parser.add_argument("--check-requests", type=int, default=4)
    parser.add_argument("--check-tokens", type=int, default=4,
                        help="greedy tokens compared with transformers (bf16 random weights have near-ties: "
                             "later tokens may legitimately differ)")
    parser.add_argument("--engines", default="rosellm,hf-generate,hf-continuous")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the engines that an interrupted run with the same settings had finished")
    parser.add_argument("--quick", action="store_true", help="a small workload on a small random model")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--figure", type=Path, default=None)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def write_random_model(folder: Path, shape: dict, seed: int = 0) -> Path:
    """A random Llama of the given shape in bf16, with a word-level tokenizer covering its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    vocab = {f"<{i}>": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<0>", bos_token="<1>", eos_token="<2>",
                            pad_token="<0>").save_pretrained(folder)
    return folder


def run(args) -> dict | None:
    if not cuda_available():
        print(NO_CUDA, file=sys.stderr)
        return None
    if args.quick:
        args.requests = 8 if args.requests == 256 else args.requests
        args.prompt_len = [16, 64] if args.prompt_len == [100, 1024] else args.prompt_len
        args.max_tokens = [8, 32] if args.max_tokens == [100, 1024] else args.max_tokens
        args.static_batch = 4 if args.static_batch == 64 else args.static_batch
    json_path, figure_path = output_paths(args, "offline_gpu")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rosellm-gpu-model-") as tmp, harness.OtherLoad() as whole:
        model = args.model
        if model is None:
            shape = QWEN3_0_6B_SHAPE if not args.quick else dict(QWEN3_0_6B_SHAPE, num_hidden_layers=2,
                                                                  vocab_size=4096)
            print("writing a random Qwen3-0.6B-shaped Llama (bf16) to a temporary folder ...", flush=True)
            model = str(write_random_model(Path(tmp), shape))
        result = measure(args, model)
    return harness.finish_run(result, whole.share, started, json_path, [figure_path],
                              lambda r: plot_gpu(r, figure_path), report,
                              "rosellm's first greedy tokens differ from transformers'")


def measure(args, model: str) -> dict:
    machine = harness.describe_machine("cuda")
    rates = [gpu_rates(args.quick)]
    harness.print_machine(machine, rates[0])
    config = harness.model_config(model)
    params = harness.parameter_counts(config)
    requests = harness.random_requests(args.requests, tuple(args.prompt_len), tuple(args.max_tokens),
                                       config.vocab_size, args.seed)
    warmup = harness.random_requests(2, (16, 32), (4, 4), config.vocab_size, args.seed + 1000)
    work = workload_work(requests, config, params)
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    block_size = 16
    blocks = kv_blocks_needed(requests, block_size) + args.max_num_seqs
    kv_memory = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else blocks * block_size * bytes_per_token
    common = {"model": model, "device": "cuda", "dtype": "bfloat16", "requests": requests, "warmup": warmup}
    engines = [e for e in args.engines.split(",") if e]
    sample = list(range(min(args.check_requests, len(requests))))
    specs = {
        "rosellm": common | {"engine_options": {"max_num_seqs": args.max_num_seqs,
                                                "max_num_batched_tokens": args.max_batch_tokens,
                                                "max_model_len": args.prompt_len[1] + args.max_tokens[1] + 1,
                                                "block_size": block_size, "kv_cache_memory": kv_memory}},
        "hf-generate": common | {"batch_size": args.static_batch, "reference_sample": sample,
                                 "reference_tokens": args.check_tokens},
        "hf-continuous": common | {"cb_options": {"max_requests_per_batch": args.max_num_seqs}},
    }
    if "hf-generate" not in engines:
        specs["hf-generate"]["reference_only"], engines = True, engines + ["hf-generate"]
    runs = {name: harness.run_worker(name, specs[name], LABELS[name], args.resume, not args.quick) for name in
            ("rosellm", "hf-generate", "hf-continuous") if name in engines}
    rates.append(gpu_rates(args.quick))
    roof = harness.rooflines(rates, params, bytes_per_weight=2)
    summaries, checks = summarize_runs(runs, specs["hf-generate"].get("reference_only"), requests, work, roof)
    for s in summaries:
        s["peak_cuda_allocated_mib"] = (s.get("memory") or {}).get("peak_cuda_allocated_mib")
    # bf16 on random weights: the first token (the prefill's) must agree; later ones may flip on near-ties
    first_ok = all(m["first_difference_at"] > 0 for m in checks.get("rosellm", {}).get("mismatches", []))
    agree = {f"rosellm vs {n}": agreement(runs["rosellm"]["tokens"], r["tokens"])
             for n, r in runs.items() if n != "rosellm" and r.get("tokens") and runs.get("rosellm", {}).get("tokens")}
    return {
        "workload": "offline-gpu",
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "model": "random Llama with Qwen3-0.6B's shape (bf16)" if args.model is None else args.model,
        "model_shape": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim")},
        "dtype": "bfloat16",
        "machine": machine,
        "settings": {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "seed": args.seed, "greedy": True, "ignore_eos": True, "static_batch": args.static_batch,
                     "rosellm_engine_options": specs["rosellm"]["engine_options"],
                     "transformers_cb_options": specs["hf-continuous"]["cb_options"], "engines": engines},
        "parameters": params,
        "work": work,
        "roofline": roof,
        "engines": summaries,
        "check": checks,
        "correct": "rosellm" not in runs or first_ok,
        "agreement": agree,
        "decode_sweep": [],
        "profile": None,
        "targets": targets_met(summaries),
        "notes": ["Rooflines from a bf16 torch.mm (8192^3) and a 1 GiB device copy; weights counted at 2 bytes."],
    }


def gpu_rates(quick: bool) -> dict:
    with harness.OtherLoad() as other:
        gemm = harness.measure_gemm(n=2048 if quick else 8192, repeats=5, dtype="bfloat16", device="cuda")
        bandwidth = harness.measure_bandwidth(mib=256 if quick else 1024, repeats=5, device="cuda")
    return {"gemm": gemm, "bandwidth": bandwidth, "other_processes_cpu_share": other.share}


def plot_gpu(result: dict, path: Path) -> None:
    from .offline_cpu import plot

    plot(result, path)
