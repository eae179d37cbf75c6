"""Speculative decoding put together: the draft model checked before anything loads, and the proposer built.

The engine asks the proposer for drafts before each step and verifies them in the step (engine/llm_engine.py,
sample/rejection_sampler.py); the proposers are ngram_proposer.py and draft_proposer.py.
"""

import torch

from ..config.engine import EngineConfig
from ..config.speculative import SpeculativeConfig
from ..model_executor.model_loader import loader
from ..model_executor.model_loader.quantization import check_options, read_config
from .proposer import Proposer


def check_draft_model(model, device, speculative: SpeculativeConfig) -> None:
    """A draft model must share the target's vocabulary, and its quantization must suit it: ValueError
    otherwise, from the models' headers alone (no weight is read)."""
    if speculative.method != "draft_model":
        return
    draft = model if speculative.model is None else speculative.model
    check_options(draft, device, None, speculative.quantization)
    target_vocab = read_config(loader.model_source(model)).vocab_size
    draft_vocab = read_config(loader.model_source(draft)).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the draft model's vocabulary ({draft_vocab} tokens) must be the target's ({target_vocab} tokens): "
            "its tokens are proposed to the target as they are"
        )


def make_proposer(
    speculative: SpeculativeConfig | None,
    model,
    device: str | torch.device,
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
) -> Proposer | None:
    """The proposer `speculative` asks for (None: no speculation). A draft model computes in the dtype
    "auto" picks for its quantization (bf16 where the CPU has it: where its 4-bit kernels are fast), and
    gets a KV pool of as many blocks as the target's."""
    if speculative is None:
        return None
    if speculative.method == "ngram":
        from .ngram_proposer import NgramProposer

        return NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    from .draft_proposer import DraftModelProposer

    return DraftModelProposer(
        model if speculative.model is None else speculative.model,
        device,
        None,
        config.attention_backend,
        config.enforce_eager,
        speculative.quantization,
        num_blocks,
        config.block_size,
        max_model_len,
        config.int8_activations,
    )
