"""offline-gpu: nano-vllm's throughput workload on a GPU, rosellm against transformers.

256 sequences of random token ids, input and output lengths uniform in [100, 1024], EOS ignored, on a ~0.6 B
Llama-shaped model with random weights (Qwen3-0.6B's shape as a `LlamaConfig`) in bf16, written to a
temporary Hugging Face folder. nano-vllm samples at temperature 0.6; greedy decoding is used here so that the
engines' tokens can be compared (bf16 on random weights has near-ties: only the first tokens are checked).
The engines and the report are offline-cpu's (rosellm from the latest checkpoint, or the one `--checkpoint`
names). Without a CUDA device it says so and exits (status 0).

    python -m benchmarks offline-gpu
"""

import sys
import tempfile
from functools import partial
from pathlib import Path

from . import harness, offline_cpu

NAME = "offline-gpu"
HELP = "nano-vllm's workload (256 seqs, ~0.6B random Llama, bf16): rosellm vs transformers; CUDA only"
CHAPTER = 7  # the step engine (`LLMEngine`) appears; the latest checkpoint by default, any from 07 by --checkpoint

FULL = offline_cpu.FULL | {"requests": 256, "prompt_len": [100, 1024], "max_tokens": [100, 1024]}
FULL |= {"static_batch": 64, "max_num_seqs": 256, "max_batch_tokens": 16384, "check_tokens": 4}
FULL |= {"sweep": [0], "profile_every": 0}
QUICK = {"requests": 8, "prompt_len": [16, 64], "max_tokens": [8, 32], "static_batch": 4}
SHAPE = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28}
SHAPE |= {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096}
SHAPE |= {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def add_arguments(parser) -> None:
    parser.add_argument("--engines", default=",".join(offline_cpu.ENGINES))
    parser.set_defaults(peers="")  # the peers are CPU builds


def write_random_model(folder: Path, shape: dict) -> str:
    """A random Llama of the given shape in bf16, with a word-level tokenizer covering its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(shape["vocab_size"])}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = dict(unk_token="<0>", bos_token="<1>", eos_token="<2>", pad_token="<0>")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(folder)
    return str(folder)


def run(args, s: dict) -> dict | None:
    import torch

    if not torch.cuda.is_available():
        print("offline-gpu: no CUDA device here; it runs only on a GPU. Nothing measured or written.", file=sys.stderr)
        return None
    random = args.model is None
    with tempfile.TemporaryDirectory(prefix="rosellm-gpu-model-") as tmp:
        if random:
            shape = SHAPE | ({"num_hidden_layers": 2, "vocab_size": 4096} if args.quick else {})
            args.model = write_random_model(Path(tmp), shape)
        rates = partial(harness.measure_rates, args.quick, "cuda", "bfloat16", 2048 if args.quick else 8192, 1024)
        named = {"model": "random Llama with Qwen3-0.6B's shape (bf16)"} if random else {}
        draw, show, finish = offline_cpu.plot, offline_cpu.report, lambda body: body | named
        return offline_cpu.run_workload(
            args, s, NAME, "offline_gpu", draw, show, finish, device="cuda", dtype="bfloat16", rates=rates
        )
