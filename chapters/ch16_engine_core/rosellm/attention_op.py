"""Attention as one operator, so that torch.compile takes a whole forward as one graph.

A backend's `store_kv` and `paged_attention` are Python that torch.compile cannot trace whole (plans, row
groups, Triton launches). Wrapped in an operator (operators.py) they are one opaque call in the graph:
Inductor calls it like an extern kernel, in order, and never breaks the graph around it. The operator writes
the new keys and values into the layer's caches, so it declares that it mutates them (`mutates_args`).

Backends hold nothing between calls, so the operator finds them by name: `register_backend` puts one in
`BACKENDS`, and the operator's `backend` argument names it. What the backend planned for the forward
(`metadata.plan`), and the metadata's ints (`max_query_len`, `max_seq_len`), stay out of the graph: an
object cannot be a graph input, and an int would be guarded on and compiled for each value. The caller runs
the forward inside `forward_context(metadata)` (vLLM's forward context), and the operator reads them there;
the metadata's tensors come in as arguments. The first operator call of a forward without a plan makes it:
a forward that never calls the operator (a compiled step of decoding rows attends by itself) costs no plan.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import record_function

from .attention_metadata import AttentionMetadata
from .operators import define_operator

BACKENDS: dict[str, object] = {}  # backend name -> a backend (stateless: any one of that name will do)

_context: list[AttentionMetadata] = []  # the metadata of the forward that is running


def register_backend(backend) -> None:
    """Make `backend` the one the operator runs when it is asked for `backend.name`."""
    BACKENDS[backend.name] = backend


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Every attention call inside reads `metadata`'s plan and ints."""
    _context.append(metadata)
    try:
        yield
    finally:
        _context.pop()


def _output(query: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty_like(query)


@define_operator(__package__, fake=_output, mutates_args=("keys", "values"))
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """Store the new keys and values [num_tokens, kv_heads, head_dim] at their slots of layer `layer`'s
    caches in the pool's `keys` and `values` [num_layers, num_blocks, block_size, kv_heads, head_dim], then
    attend: query [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], with backend `backend` and
    the plan of the running forward. (The whole pool, not the layer's view of it, is the argument: Inductor
    keeps a mutated graph input in place, where a mutated view may be rebuilt at the wrong offset.)"""
    # The same dispatch state on every call, however the graph reaches the operator: code compiled inside a
    # backend is guarded on it, and would otherwise be compiled twice.
    with record_function("rosellm.attention"), torch._C._AutoDispatchBelowADInplaceOrView():
        running, chosen = _context[-1], BACKENDS[backend]
        if running.plan is None:  # the forward's first attention: plan once for every layer
            running.plan = chosen.plan(running, keys.shape[2])
        metadata = AttentionMetadata(
            running.positions,
            slot_mapping,
            query_start_loc,
            query_lens,
            seq_lens,
            block_tables,
            running.max_query_len,
            running.max_seq_len,
            running.plan,
        )
        key_cache, value_cache = keys[layer], values[layer]
        chosen.store_kv(key, value, key_cache, value_cache, slot_mapping)  # write through the slot mapping
        return chosen.paged_attention(query, key_cache, value_cache, metadata)  # read through the block tables
