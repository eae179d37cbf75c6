"""Each Triton kernel equals its chapter-05 PyTorch reference (`paged_attention.py`).

Without CUDA the kernels run in Triton's interpreter (see conftest.py), which is slow: the cases are
few and small, chosen so that together they cover block sizes 1, 16 and 32, head_dim 64 and 128, GQA
ratios 1, 3 and 4, lengths 1, a block boundary and one past it, shuffled block ids, and 1 or several
splits. With CUDA the same cases run compiled on the GPU.
"""

import dataclasses

import pytest
import torch

from chapters import submodule
from tests.ch05_paged_attention.paged_data import make_problem

pytestmark = pytest.mark.slow  # interpreted on a CPU: its checkpoint and the latest (all: --all-checkpoints)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The kernel and the reference each round their output to the dtype once; in fp16 that is up to one
# unit in the last place each (9.8e-4 for |x| in [1, 2)). Measured on CPU: fp32 <= 7e-7, fp16 <= 9.8e-4.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}

HEADS = {  # name: (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3 and 4, head_dim 64 and 128
    f"{name}_d{head_dim}": (num_heads, num_kv_heads, head_dim)
    for name, num_heads, num_kv_heads in [("mha", 2, 2), ("gqa3", 6, 2), ("gqa4", 8, 2)]
    for head_dim in (64, 128)
}


def kernels_of(checkpoint):
    return submodule(checkpoint, "kernels")


def on_device(problem):
    """make_problem builds on the CPU; move its tensors (metadata included) to DEVICE."""
    query, key_cache, value_cache, metadata, _, _ = problem
    moved = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
    moved = {name: v.to(DEVICE) if torch.is_tensor(v) else v for name, v in moved.items()}
    return query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), type(metadata)(**moved)


def reference(checkpoint, query, key_cache, value_cache, metadata):
    return checkpoint.paged_attention.paged_attention(query, key_cache, value_cache, metadata)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
def test_store_kv_equals_reference(checkpoint, dtype, block_size, heads):
    _, num_kv_heads, head_dim = HEADS[heads]
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 6, 2 * block_size + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Keys as a strided view (every other head of a wider tensor), values contiguous.
    key = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype)[:, ::2]
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # scattered over the pool
    slots[1::4] = -1  # tokens with nowhere to go
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    checkpoint.paged_attention.store_kv(key, value, expected_k, expected_v, slots)

    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    kernels_of(checkpoint).store_kv(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))
    assert torch.equal(key_cache.cpu(), expected_k) and torch.equal(value_cache.cpu(), expected_v)  # a copy: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
def test_decode_equals_reference(checkpoint, dtype, block_size, heads):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    seq_lens = [1, block_size, block_size + 1, 70]  # 70: three loop steps of 32 keys, or three splits
    query, key_cache, value_cache, metadata = on_device(
        make_problem(
            checkpoint, seq_lens, [1] * 4, block_size, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=block_size
        )
    )
    expected = reference(checkpoint, query, key_cache, value_cache, metadata)
    for num_splits in (1, 3):  # with 3, the short sequences have empty splits
        out = kernels_of(checkpoint).paged_decode_attention(
            query,
            key_cache,
            value_cache,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_seq_len,
            num_splits=num_splits,
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_number_of_splits_adapts_to_the_length(checkpoint):
    choose = kernels_of(checkpoint).choose_num_splits
    assert choose(1) == choose(200) == 1
    assert 1 < choose(600) < choose(2000) <= choose(100_000)
    assert choose(100_000) == choose(1_000_000)  # capped


def test_decode_with_the_chosen_splits(checkpoint):
    """A long sequence beside a short one, with the number of splits the kernel picks (more than 1)."""
    seq_lens = [600, 5]
    query, key_cache, value_cache, metadata = on_device(make_problem(checkpoint, seq_lens, [1, 1], 16, 4, 1, 64))
    assert kernels_of(checkpoint).choose_num_splits(metadata.max_seq_len) > 1
    out = kernels_of(checkpoint).paged_decode_attention(
        query, key_cache, value_cache, metadata.seq_lens, metadata.block_tables, metadata.max_seq_len
    )
    torch.testing.assert_close(
        out, reference(checkpoint, query, key_cache, value_cache, metadata), **TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
def test_prefill_equals_reference(checkpoint, dtype, block_size, heads):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    # Whole prompts of 1, block_size and block_size + 1 tokens; a prompt whose first 16 tokens are
    # cached (24 new of 40); a sequence decoding one token in the same batch (1 new of 20).
    seq_lens = [1, block_size, block_size + 1, 40, 20]
    query_lens = [1, block_size, block_size + 1, 24, 1]
    query, key_cache, value_cache, metadata = on_device(
        make_problem(
            checkpoint,
            seq_lens,
            query_lens,
            block_size,
            num_heads,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            seed=block_size,
        )
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
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference(checkpoint, query, key_cache, value_cache, metadata), **TOLERANCE[dtype])


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 5, 1]], ids=["decode", "mixed"])
def test_dispatch_picks_decode_or_prefill(checkpoint, query_lens, monkeypatch):
    """The backend's paged_attention: the decode kernel when every sequence has one new token."""
    kernels = kernels_of(checkpoint)
    called = []

    def spy(name):
        original = getattr(kernels, name)

        def recording(*args, **kwargs):
            called.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, recording)

    spy("paged_decode_attention")
    spy("paged_prefill_attention")
    query, key_cache, value_cache, metadata = on_device(make_problem(checkpoint, [3, 17, 9], query_lens, 16, 2, 1, 64))
    out = kernels.paged_attention(query, key_cache, value_cache, metadata)
    assert called == ["paged_decode_attention" if max(query_lens) == 1 else "paged_prefill_attention"]
    torch.testing.assert_close(
        out, reference(checkpoint, query, key_cache, value_cache, metadata), **TOLERANCE[torch.float32]
    )
