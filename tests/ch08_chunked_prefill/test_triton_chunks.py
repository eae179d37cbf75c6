"""Chapter 06's prefill kernel on chunks that start in the middle of a sequence: equal to the reference.

A chunk of q new tokens after c computed ones is the prefill of a prompt whose first c tokens are cached:
the kernel places new token i at position c + i and lets it see keys 0 ... c + i. Interpreted on a CPU.
"""

import pytest
import torch

from tests.ch05_paged_attention.paged_data import make_problem
from tests.ch06_triton_kernels.test_kernels import DEVICE, TOLERANCE, kernels_of, on_device, reference
from tests.needs_triton import TRITON_MISSING

pytestmark = [
    pytest.mark.slow,
    pytest.mark.requires("triton_kernels", "chunked_prefill"),
    pytest.mark.skipif(TRITON_MISSING is not None, reason=str(TRITON_MISSING)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunks_starting_mid_sequence_equal_the_reference(checkpoint, dtype, block_size):
    # computed before the chunk: 2 blocks exactly (aligned), 2 blocks + 3, 1 token, and a decode beside them
    computed = [2 * block_size, 2 * block_size + 3, 1, 29]
    chunk = [block_size, 7, 2 * block_size + 1, 1]
    seq_lens = [c + q for c, q in zip(computed, chunk)]
    query, key_cache, value_cache, metadata = on_device(
        make_problem(checkpoint, seq_lens, chunk, block_size, 6, 2, 64, dtype=dtype, seed=block_size)
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


def test_the_engine_on_triton_with_chunks_equals_torch(checkpoint, tiny_model_dirs):
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in enumerate([19, 6, 33])]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = checkpoint.LLM(
            str(tiny_model_dirs["gqa"]),
            device=DEVICE,
            dtype=torch.float32,
            block_size=4,
            max_num_batched_tokens=8,
            max_num_seqs=3,
            attention_backend=backend,
        )
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
