"""The hand-written decode-attention kernel (decode_attention.c) gives what dense attention gives, reads
nothing past a sequence's end, and gives way to the compiled tensor algebra where it does not serve."""

import shutil

import pytest
import torch

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem

# (seq_lens, heads, kv_heads, head_dim): one sequence, ragged batches, GQA / MQA / MHA, SmolLM2's shapes
DECODE_BATCHES = [
    ([1], 4, 2, 16),
    ([37], 4, 1, 32),
    ([5, 1, 33, 16, 17], 4, 2, 16),
    ([64, 3, 48, 2, 9, 30, 31], 4, 4, 16),
    ([200, 17, 1, 129], 9, 3, 64),
]


@pytest.fixture(autouse=True)
def a_compiler():
    assert shutil.which("cc") or shutil.which("gcc"), "no C compiler: install one (Inductor needs it too)"


def kernel_served(checkpoint, dtype, heads, kv_heads, head_dim, block_size) -> bool:
    return checkpoint.cpu_attention._kernel(dtype, head_dim, heads // kv_heads, kv_heads, block_size) is not None


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim", DECODE_BATCHES)
def test_kernel_equals_dense_attention(checkpoint, seq_lens, heads, kv_heads, head_dim, block_size, dtype, tolerance):
    query_lens = [1] * len(seq_lens)
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, block_size, heads, kv_heads, head_dim, dtype=dtype
    )
    assert kernel_served(checkpoint, dtype, heads, kv_heads, head_dim, block_size)
    tables, seq_lens_long = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    out = checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, seq_lens_long)
    assert out.dtype == dtype and out.shape == query.shape
    expected = dense_attention(query, dense_k, dense_v, seq_lens, query_lens)  # fp32 on the same inputs
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_nothing_past_a_sequence_end_is_read(checkpoint):
    """NaN in every slot that no sequence holds (the tail of each last block, the unused blocks): the
    output is the same, and finite."""
    seq_lens, query_lens = [5, 16, 23], [1, 1, 1]
    query, key_cache, value_cache, metadata, _, _ = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, 16)
    tables, lens = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    expected = checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, lens)
    held = torch.zeros(key_cache.shape[:2], dtype=torch.bool)  # [num_blocks, block_size]
    for row, n in zip(metadata.block_tables.tolist(), seq_lens):
        for position in range(n):
            held[row[position // 16], position % 16] = True
    key_cache[~held], value_cache[~held] = float("nan"), float("nan")
    out = checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, lens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.requires("compiled")
@pytest.mark.parametrize(
    "dtype, head_dim",
    [(torch.float32, 8), (torch.float16, 16)],  # head_dim not a multiple of 16; an element type it has no code for
)
def test_shapes_it_does_not_serve_go_to_the_compiled_path(checkpoint, dtype, head_dim):
    seq_lens, query_lens = [9, 1, 20], [1, 1, 1]
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, 4, 4, 2, head_dim, dtype=dtype
    )
    assert not kernel_served(checkpoint, dtype, 4, 2, head_dim, 4)
    tables, lens = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    out = checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, lens)
    expected = checkpoint.cpu_attention.compiled_decode_attention(query, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_compiled_once_per_shapes_into_the_cache_and_none_where_it_cannot_be(checkpoint, tmp_path, monkeypatch):
    load = checkpoint.c_kernels.load.__wrapped__  # the uncached function: every call looks at the disk
    shapes = dict(SCALAR="float", BF16=0, HEAD_DIM=16, GROUP=2, KV_HEADS=2, BLOCK_SIZE=4)
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    assert load("decode_attention", **shapes) is not None
    built = sorted((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    assert load("decode_attention", **shapes) is not None and built[0].stat().st_mtime_ns == stamp  # not rebuilt
    assert load("decode_attention", **shapes | {"BLOCK_SIZE": 8}) is not None
    assert len(list((tmp_path / "kernels").iterdir())) == 2  # other shapes, another library
    monkeypatch.setenv("CC", "false")  # a compiler that fails whatever it is given
    assert load("decode_attention", **shapes | {"BLOCK_SIZE": 2}) is None
    assert len(list((tmp_path / "kernels").iterdir())) == 2  # and leaves nothing behind
    monkeypatch.delenv("CC")
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    monkeypatch.setenv("ROSELLM_CACHE", str(unwritable))  # its kernels folder cannot be made
    assert load("decode_attention", **shapes | {"BLOCK_SIZE": 2}) is None


def test_loading_a_kernel_leaves_subnormal_numbers_alone(checkpoint):
    """Compiled with -ffast-math but not linked with it: loading the library must not switch the process to
    flushing subnormals to zero (every other computation's results would change)."""
    assert kernel_served(checkpoint, torch.float32, 4, 2, 16, 16)  # a library is loaded
    assert 5e-324 * 2.0 > 0  # the smallest subnormal double survives a multiply
    assert (torch.tensor([1e-40]) * 2).item() > 0  # and a subnormal float, in PyTorch's kernels


@pytest.mark.parametrize("broken", ["block past the pool", "negative block", "longer than its table", "empty"])
def test_tables_that_point_outside_the_pool_raise_before_the_kernel_reads(checkpoint, broken):
    seq_lens, query_lens = [5, 16, 23], [1, 1, 1]
    query, key_cache, value_cache, metadata, _, _ = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, 16)
    tables, lens = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    if broken == "block past the pool":
        tables[1, 0] = key_cache.shape[0]
    elif broken == "negative block":
        tables[2, 1] = -1
    elif broken == "longer than its table":
        lens[0] = tables.shape[1] * 16 + 1
    else:
        lens[1] = 0
    with pytest.raises(IndexError):
        checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, lens)
