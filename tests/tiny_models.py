"""Tiny random Llama models saved as Hugging Face folders, with a tiny byte-level BPE tokenizer."""

from pathlib import Path

import torch

# Each config exercises one feature of the architecture.
TINY_CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa_tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3_rope": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "An inference engine turns a prompt into tokens, and tokens into text.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Café, naïve, jalapeño, smörgåsbord, déjà vu.",
    "你好，世界。大语言模型推理引擎。",
    "Emoji: 🚀🔥😀 and a family 👨‍👩‍👧.",
    "def forward(self, x):\n    return self.proj(x) + x\n",
] * 20


def make_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tiny_model(folder: Path, name: str, seed: int = 0) -> Path:
    """Write a seeded random Llama (and its tokenizer) to `folder` in Hugging Face format."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        **TINY_CONFIGS[name],
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
