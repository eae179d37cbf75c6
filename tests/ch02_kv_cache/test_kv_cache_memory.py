"""The contiguous per-request cache (replaced by a paged pool in chapter 05)."""

import pytest
import torch

pytestmark = pytest.mark.requires("contiguous_cache")


def test_bytes_per_token_formula_with_smollm2_numbers(checkpoint):
    config = checkpoint.config.ModelConfig.from_dict(
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
        )
    )
    # 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes
    assert checkpoint.kv_cache.KVCache.bytes_per_token(config, torch.float32) == 46080
    assert checkpoint.kv_cache.KVCache.bytes_per_token(config, torch.bfloat16) == 23040


def test_cache_writes_position_i_at_index_i(checkpoint, tiny_model_dirs):
    config = checkpoint.config.ModelConfig.from_json(tiny_model_dirs["gqa"] / "config.json")
    cache = checkpoint.kv_cache.KVCache(config, capacity=8, dtype=torch.float32, device=torch.device("cpu"))
    prompt_k = torch.randn(1, config.num_key_value_heads, 5, config.head_dim)
    keys, _ = cache.update(0, prompt_k, prompt_k)
    assert torch.equal(keys[0], prompt_k[0])
    cache.advance(5)
    step_k = torch.randn(1, config.num_key_value_heads, 1, config.head_dim)
    keys, values = cache.update(0, step_k, step_k)
    assert keys.shape == (1, config.num_key_value_heads, 6, config.head_dim)
    assert torch.equal(keys[0, :, 5], step_k[0, :, 0]) and torch.equal(keys[0, :, :5], prompt_k[0])
