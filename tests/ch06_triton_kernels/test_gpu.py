"""On a CUDA device: the kernels, compiled, at sizes the interpreter could not afford, in the dtypes a GPU
serves in; and the engine end to end. Reported as skipped (the one allowed skip) where no CUDA device exists.

Run them where there is a GPU: pytest tests/ch06_triton_kernels -m gpu
"""

import pytest
import torch

from chapters import submodule
from tests.ch03_batch_decode.test_batch_generate import MIXED_PROMPTS
from tests.ch05_paged_attention.paged_data import make_problem
from tests.ch06_triton_kernels.test_kernels import on_device, reference
from tests.ch06_triton_kernels.test_triton_engine import attention_backend_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Output rounding of kernel and reference: one bf16 ulp is 7.8e-3 for |x| in [1, 2), one fp16 ulp 9.8e-4.
TOLERANCE = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def kernels_of(checkpoint):
    return submodule(checkpoint, "kernels")


@DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(32, 8, 128), (9, 3, 64)])
def test_decode_long_contexts(checkpoint, dtype, block_size, num_heads, num_kv_heads, head_dim):
    seq_lens = [1, 255, 256, 257, 1000, 4097]  # 4097 keys: the chosen number of splits is more than 1
    query, key_cache, value_cache, metadata = on_device(
        make_problem(
            checkpoint, seq_lens, [1] * len(seq_lens), block_size, num_heads, num_kv_heads, head_dim, dtype=dtype
        )
    )
    out = kernels_of(checkpoint).paged_decode_attention(
        query, key_cache, value_cache, metadata.seq_lens, metadata.block_tables, metadata.max_seq_len
    )
    torch.testing.assert_close(out, reference(checkpoint, query, key_cache, value_cache, metadata), **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_long_prompts(checkpoint, dtype, block_size):
    seq_lens, query_lens = [1, 300, 1030, 700], [1, 300, 1030, 200]  # the last: 500 tokens cached
    query, key_cache, value_cache, metadata = on_device(
        make_problem(checkpoint, seq_lens, query_lens, block_size, 32, 8, 128, dtype=dtype)
    )
    out = kernels_of(checkpoint).paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        metadata.max_query_len,
    )
    torch.testing.assert_close(out, reference(checkpoint, query, key_cache, value_cache, metadata), **TOLERANCE[dtype])


@DTYPES
def test_store_kv_many_tokens(checkpoint, dtype):
    key_cache = torch.zeros(512, 16, 8, 128, dtype=dtype, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(3000, 8, 128, device="cuda").to(dtype)
    slots = torch.randperm(512 * 16, device="cuda")[:3000]
    slots[::7] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    checkpoint.paged_attention.store_kv(key, -key, expected_k, expected_v, slots)
    kernels_of(checkpoint).store_kv(key, -key, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_engine_on_cuda_defaults_to_triton_and_matches_torch(checkpoint, tiny_model_dirs):
    outputs = {}
    for backend in (None, "torch"):
        llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), device="cuda", dtype=torch.float32, attention_backend=backend)
        assert attention_backend_of(llm).name == (backend or "triton")
        params = checkpoint.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outputs[backend] = [o.token_ids for o in llm.generate(MIXED_PROMPTS, params, use_tqdm=False)]
    assert outputs[None] == outputs["torch"]


@pytest.mark.model
def test_smollm2_bf16_on_cuda_runs_on_triton(checkpoint, smollm2_path):
    llm = checkpoint.LLM(device="cuda")  # bf16 and the triton backend: the defaults on CUDA
    assert llm.model.lm_head.weight.dtype == torch.bfloat16 and attention_backend_of(llm).name == "triton"
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    [output] = llm.generate([prompt], checkpoint.SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in output.text
