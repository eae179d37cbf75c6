"""Our Llama equals transformers' LlamaForCausalLM, logit for logit (fp32, atol 1e-4; see `logits_tolerance`)."""

import pytest
import torch

from tests.engine_options import logits_tolerance
from tests.oracle import hf_logits
from tests.tiny_models import TINY_CONFIGS


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("seq_len", [1, 7, 33, 129])
def test_tiny_logits_match_transformers(checkpoint, tiny_model_dirs, tiny_hf_models, name, seq_len):
    llm = checkpoint.LLM(str(tiny_model_dirs[name]))
    token_ids = torch.randint(
        0, llm.model.config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(seq_len)
    ).tolist()
    ours = llm.prompt_logits(token_ids)
    theirs = hf_logits(tiny_hf_models[name], token_ids)
    assert ours.shape == theirs.shape == (seq_len, llm.model.config.vocab_size)
    torch.testing.assert_close(ours, theirs, **logits_tolerance(checkpoint))


def test_llama3_rope_scaling_is_exercised(checkpoint, tiny_model_dirs):
    """The llama3 case would prove nothing if its frequencies equalled the default ones."""
    config = checkpoint.LLM(str(tiny_model_dirs["llama3_rope"])).model.config
    scaled = checkpoint.model.rope_inverse_frequencies(config)
    config.rope_scaling = None
    plain = checkpoint.model.rope_inverse_frequencies(config)
    assert torch.equal(scaled[:1], plain[:1])  # the highest frequency is kept
    assert torch.allclose(scaled[-2:], plain[-2:] / 8.0)  # the low ones are slowed down by `factor`


def test_undo_rope_permutation_inverts_the_gguf_layout(checkpoint):
    """llama.cpp stores each head's rows as interleaved pairs; we must restore rotate-half order."""
    num_heads, head_dim, hidden = 3, 8, 5
    hf_layout = torch.arange(num_heads * head_dim * hidden, dtype=torch.float32).reshape(-1, hidden)
    # What the converter does: per head, rows [2, head_dim/2] -> [head_dim/2, 2].
    gguf_layout = hf_layout.reshape(num_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(-1, hidden)
    assert not torch.equal(gguf_layout, hf_layout)
    assert torch.equal(checkpoint.loader.undo_rope_permutation(gguf_layout, num_heads), hf_layout)


@pytest.mark.model
def test_smollm2_logits_match_transformers_reading_the_same_gguf(checkpoint, smollm2_llm, smollm2_hf):
    prompt = "The capital of France is Paris, and the capital of Germany is"
    token_ids = smollm2_llm.tokenizer.encode(prompt)
    ours = smollm2_llm.prompt_logits(token_ids)
    theirs = hf_logits(smollm2_hf, token_ids)
    torch.testing.assert_close(ours, theirs, **logits_tolerance(checkpoint))
    config = smollm2_llm.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert config.tie_word_embeddings
