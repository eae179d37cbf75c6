"""The hand-written decode-attention kernel (decode_attention.c) gives what dense attention gives at every
CPU level it is built for, reads nothing past a sequence's end nor past its tables, and gives way to the
compiled tensor algebra where it does not serve (eager tensor algebra where nothing can be compiled)."""

import platform
import shutil

import pytest
import torch

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem
from tests.ch13_quantization.cpu_levels import VARIABLE, levels

pytestmark = pytest.mark.cpu_features

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
    shapes = (dtype, head_dim, heads // kv_heads, kv_heads, block_size)
    return checkpoint.cpu_attention._kernel(*shapes, checkpoint.c_kernels.setting()) is not None


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


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim", [DECODE_BATCHES[2], DECODE_BATCHES[4]])
def test_every_cpu_level_equals_dense_attention(
    checkpoint, tmp_path, monkeypatch, level, seq_lens, heads, kv_heads, head_dim, dtype, tolerance
):
    """Masked to each level, the kernel is compiled with that level's flags into a library of its own; at
    "nocc" none is built and nothing is compiled: the tensor algebra runs eagerly. Each equals dense attention."""
    monkeypatch.setenv(VARIABLE, level)
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    compiles = []
    run = checkpoint.c_kernels.subprocess.run
    monkeypatch.setattr(
        checkpoint.c_kernels.subprocess, "run", lambda args, **kw: compiles.append(args) or run(args, **kw)
    )

    def never(*args):
        raise AssertionError("compiled at level nocc")

    if level == "nocc":
        monkeypatch.setattr(checkpoint.cpu_attention, "compiled_decode_attention", never)
    query_lens = [1] * len(seq_lens)
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, 16, heads, kv_heads, head_dim, dtype=dtype
    )
    tables, seq_lens_long = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    out = checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, seq_lens_long)
    expected = dense_attention(query, dense_k, dense_v, seq_lens, query_lens)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    built = sorted(path.name for path in (tmp_path / "kernels").glob("*.so"))
    compile_steps = [args for args in compiles if "-c" in args]
    if level == "nocc":
        assert built == [] and compile_steps == []
        return
    assert len(built) == 1 and built[0].startswith(f"decode_attention-{level}-")
    target = checkpoint.c_kernels.target_flags(platform.machine(), level, masked=True)
    assert len(compile_steps) == 1 and all(flag in compile_steps[0] for flag in target)  # the first try compiled


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


def test_loading_a_kernel_leaves_subnormal_numbers_alone(checkpoint):
    """Compiled with -ffast-math but not linked with it: loading the library must not switch the process to
    flushing subnormals to zero (every other computation's results would change)."""
    assert kernel_served(checkpoint, torch.float32, 4, 2, 16, 16)  # a library is loaded
    assert 5e-324 * 2.0 > 0  # the smallest subnormal double survives a multiply
    assert (torch.tensor([1e-40]) * 2).item() > 0  # and a subnormal float, in PyTorch's kernels


BROKEN_TABLES = [
    "block past the pool",
    "negative block",
    "longer than its table",
    "empty",
    "tables and lengths for more rows than queries",
    "lengths for fewer rows than queries",
]


@pytest.mark.parametrize("broken", BROKEN_TABLES)
def test_tables_that_point_outside_the_pool_raise_before_the_kernel_reads(checkpoint, broken):
    seq_lens, query_lens = [5, 16, 23], [1, 1, 1]
    query, key_cache, value_cache, metadata, _, _ = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, 16)
    tables, lens = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    assert kernel_served(checkpoint, query.dtype, 4, 2, 16, 16)
    if broken == "block past the pool":
        tables[1, 0] = key_cache.shape[0]
    elif broken == "negative block":
        tables[2, 1] = -1
    elif broken == "longer than its table":
        lens[0] = tables.shape[1] * 16 + 1
    elif broken == "empty":
        lens[1] = 0
    elif broken == "tables and lengths for more rows than queries":
        query = query[:2]
    else:
        lens = lens[:2]
    with pytest.raises(IndexError):
        checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, lens)


def test_the_kernel_says_when_no_memory_holds_the_scores(checkpoint):
    """Called directly with a table width whose scores no memory holds (2**54 blocks: 2**60 bytes), the kernel
    reports the row it could not compute instead of writing through a null pointer."""
    kernel = checkpoint.cpu_attention._kernel(torch.float32, 16, 2, 2, 4, checkpoint.c_kernels.setting())
    query, cache = torch.randn(1, 4, 16), torch.randn(2, 4, 2, 16)  # [batch, heads, head_dim]; a pool of 2 blocks
    table, length, out = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), torch.zeros(1, 4, 16)
    pointers = [t.data_ptr() for t in (query, cache, cache, table, length, out)]
    assert kernel(*pointers, 1, 2**54, 0.25, 1) == 1
    assert not out.any()  # its row is left as it was


def test_the_cpu_backend_is_refused_off_the_cpu_before_loading(checkpoint, tiny_model_dirs):
    """Its C kernel takes the addresses of the pool and the tables: on CUDA it would read GPU memory as CPU
    memory. A ValueError when the backend is chosen, before any weight is read (no GPU needed)."""
    message = 'attention_backend="cpu" runs on the CPU alone.*"triton" or "torch"'
    with pytest.raises(ValueError, match=message):
        checkpoint.attention_backend.get_attention_backend("cpu", "cuda")
    with pytest.raises(ValueError, match=message):
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), device="cuda", attention_backend="cpu")
