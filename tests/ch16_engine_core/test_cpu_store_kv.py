"""The "cpu" backend stores a step's keys and values where the reference does: in one indexed copy per cache
when every token has a slot, through the reference's masks when some have none (slot -1, warm-up's)."""

import pytest
import torch

pytestmark = pytest.mark.requires("engine_core")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[5, 0, 7, 2], [5, -1, 7, -1], [-1, -1, -1, -1], []])
def test_cpu_store_kv_equals_the_reference(checkpoint, dtype, slots):
    gen = torch.Generator().manual_seed(len(slots))
    caches = [torch.randn(4, 2, 3, 8, generator=gen).to(dtype) for _ in range(2)]  # [blocks, size, heads, dim]
    pools = {"cpu": caches, "ref": [cache.clone() for cache in caches]}  # the same pool before the store
    key, value = (torch.randn(len(slots), 3, 8, generator=gen).to(dtype) for _ in range(2))
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    checkpoint.cpu_attention.CpuAttentionBackend().store_kv(key, value, *pools["cpu"], slot_mapping)
    checkpoint.paged_attention.store_kv(key, value, *pools["ref"], slot_mapping)
    for stored, expected in zip(pools["cpu"], pools["ref"]):
        assert torch.equal(stored, expected)
    written = [slot for slot in slots if slot >= 0]
    if written:  # and the comparison is not of two untouched pools
        assert torch.equal(pools["cpu"][0].flatten(0, 1)[written], key[[i for i, s in enumerate(slots) if s >= 0]])
