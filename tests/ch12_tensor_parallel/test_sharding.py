"""How a model splits over ranks, worked out without any process: which heads each rank keeps, the shapes
and bytes of its slice (`RankShapes`, the numbers the chapter's tables use) against real loaded slices, and
the algebra that makes it exact: column slices put side by side are the whole layer, row-parallel partial
sums add up to the whole output."""

import pytest
import torch

from chapters import submodule

pytestmark = pytest.mark.requires("tensor_parallel")

SMOLLM2 = dict(  # SmolLM2-135M's shape
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)


def config_of(checkpoint, **fields):
    return submodule(checkpoint, "config").ModelConfig.from_dict(fields)


@pytest.mark.parametrize(
    "heads, kv_heads, size, expected",
    [
        (4, 2, 2, [[0], [1]]),  # split: one KV head each
        (4, 4, 2, [[0, 1], [2, 3]]),
        (4, 2, 4, [[0], [0], [1], [1]]),  # replicated: two ranks per KV head
        (4, 1, 4, [[0], [0], [0], [0]]),  # multi-query: every rank holds the one KV head
        (9, 3, 3, [[0], [1], [2]]),  # SmolLM2 on 3 ranks
    ],
)
def test_kv_heads_of_each_rank(checkpoint, heads, kv_heads, size, expected):
    tp = submodule(checkpoint, "tensor_parallel")
    config = config_of(checkpoint, **dict(SMOLLM2, num_attention_heads=heads, num_key_value_heads=kv_heads))
    assert [list(tp.kv_heads_of_rank(config, rank, size)) for rank in range(size)] == expected


@pytest.mark.parametrize(
    "size, message",
    [
        (2, "must divide num_attention_heads=9 "),
        (4, "must divide num_attention_heads=9"),
        (0, "must be an integer >= 1"),
    ],
)
def test_sizes_that_cannot_split_smollm2(checkpoint, size, message):
    with pytest.raises(ValueError, match=message):
        submodule(checkpoint, "tensor_parallel").check_shardable(config_of(checkpoint, **SMOLLM2), size)


def test_intermediate_rows_must_split(checkpoint):
    config = config_of(
        checkpoint, **dict(SMOLLM2, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1001)
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide intermediate_size=1001"):
        submodule(checkpoint, "tensor_parallel").check_shardable(config, 2)


def test_kv_heads_neither_split_nor_replicated(checkpoint):
    config = config_of(checkpoint, **dict(SMOLLM2, num_attention_heads=12, num_key_value_heads=3))
    with pytest.raises(ValueError, match="must divide num_key_value_heads=3 .* or be a multiple of it"):
        submodule(checkpoint, "tensor_parallel").check_shardable(config, 2)
    for size in (1, 3, 6, 12):  # 3 divides 3; 6 and 12 are multiples of 3
        submodule(checkpoint, "tensor_parallel").check_shardable(config, size)


def test_smollm2_shapes_on_3_ranks(checkpoint):
    """Worked by hand: 9 query heads and 3 KV heads of 64 dims, 1536 intermediate rows, over 3 ranks."""
    shapes = submodule(checkpoint, "tensor_parallel").RankShapes.of(config_of(checkpoint, **SMOLLM2), 3, 4)
    assert shapes.qkv_proj == ((3 + 2 * 1) * 64, 576)
    assert shapes.o_proj == (576, 3 * 64)
    assert shapes.gate_up_proj == (2 * 512, 576)
    assert shapes.down_proj == (576, 512)
    assert shapes.kv_heads == 1
    assert shapes.kv_bytes_per_token == 2 * 30 * 1 * 64 * 4  # a third of the whole model's 46,080 bytes
    assert shapes.all_reduce_bytes_per_token == 2 * 30 * 576 * 4  # 2 all-reduces per layer of a hidden vector
    per_layer = (320 + 192 + 1024) * 576 + 576 * 512 + 2 * 576
    assert shapes.weight_bytes == 4 * (30 * per_layer + 49152 * 576 + 576)  # + the embedding (tied head), norm


@pytest.mark.parametrize("name, size", [("gqa", 2), ("gqa", 4), ("mha_tied", 4), ("mqa_tied", 2)])
def test_loaded_slices_match_shapes_and_rebuild_the_layer(checkpoint, tiny_model_dirs, name, size):
    """Each rank's slice (loaded as a worker loads it) has the shapes and bytes `RankShapes` says; its
    column-parallel rows are the whole model's rows of its heads; the ranks' row-parallel partial MLP
    outputs add up to the whole MLP's output."""
    tp, loader = submodule(checkpoint, "tensor_parallel"), submodule(checkpoint, "loader")
    whole, _ = loader.load_model(tiny_model_dirs[name])
    ranks = [loader.load_model(tiny_model_dirs[name], rank=rank, size=size)[0] for rank in range(size)]
    shapes = tp.RankShapes.of(whole.config, size, 4)
    d, heads = whole.config.head_dim, whole.config.num_attention_heads // size
    q_rows = whole.config.num_attention_heads * d
    kv_rows = whole.config.num_key_value_heads * d
    x = torch.randn(5, whole.config.hidden_size)
    for layer in range(whole.config.num_hidden_layers):
        full = whole.model.layers[layer]
        partial_mlp = torch.zeros_like(x)
        for rank, part in enumerate(ranks):
            sliced = part.model.layers[layer]
            assert tuple(sliced.self_attn.qkv_proj.weight.shape) == shapes.qkv_proj
            assert tuple(sliced.self_attn.o_proj.weight.shape) == shapes.o_proj
            assert tuple(sliced.mlp.gate_up_proj.weight.shape) == shapes.gate_up_proj
            assert tuple(sliced.mlp.down_proj.weight.shape) == shapes.down_proj
            q, k, _ = sliced.self_attn.qkv_proj.weight.split([heads * d, shapes.kv_heads * d, shapes.kv_heads * d])
            kv = tp.kv_heads_of_rank(whole.config, rank, size)
            whole_qkv = full.self_attn.qkv_proj.weight
            assert torch.equal(q, whole_qkv[rank * heads * d : (rank + 1) * heads * d])
            assert torch.equal(k, whole_qkv[q_rows + kv.start * d : q_rows + kv.stop * d])
            assert kv_rows == whole.config.num_key_value_heads * d
            gate, up = sliced.mlp.gate_up_proj(x).chunk(2, dim=-1)
            partial_mlp += sliced.mlp.down_proj(torch.nn.functional.silu(gate) * up)  # before its all-reduce
        torch.testing.assert_close(partial_mlp, full.mlp(x), atol=1e-5, rtol=1e-5)
    for part in ranks:
        params = {id(p): p for p in part.parameters()}.values()  # a tied head counted once
        assert sum(p.numel() * p.element_size() for p in params) == shapes.weight_bytes
