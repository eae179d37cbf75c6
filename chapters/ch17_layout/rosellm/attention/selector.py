"""Which functions write and read the paged KV pool: a backend.

Every backend has the same three methods, and holds nothing between calls:
    plan(metadata, block_size) -> plan    once per forward, at its first attention: metadata.plan = plan
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, metadata) -> output

    "reference"  plain PyTorch (ops/paged_attention.py): the one every other backend is checked against
    "torch"      PyTorch by row groups (backends/grouped_attn.py), fast on mixed steps (the default off CUDA in
                 eager mode)
    "cpu"        decode rows read the pool in place, compiled; fresh prompts attend to their own keys; the
                 other rows as "torch" (backends/cpu_attn.py; the default off CUDA; on the CPU alone)
    "triton"     the Triton kernels (kernels/; the default on CUDA)
"""

import importlib.util
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backends.cpu_attn import CpuAttentionBackend
from .backends.grouped_attn import GroupedAttentionBackend
from .ops import paged_attention

BACKENDS = ("reference", "torch", "cpu", "triton")


@dataclass(frozen=True)
class StatelessBackend:
    """A backend made of two functions, with nothing to plan."""

    name: str
    store_kv: Callable
    paged_attention: Callable
    graph_decode: Callable | None = None  # a backend that attends one decoding token inside a compiled graph

    def plan(self, metadata, block_size: int) -> None:
        return None


REFERENCE_BACKEND = StatelessBackend("reference", paged_attention.store_kv, paged_attention.paged_attention)


def get_attention_backend(name: str | None, device: torch.device | str, enforce_eager: bool = False):
    """name: one of BACKENDS, or None ("triton" on CUDA; elsewhere "cpu", or "torch" when `enforce_eager`
    asks for nothing compiled). A new backend each call, so each model has its
    own."""
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" else "torch" if enforce_eager else "cpu"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
    if name == "reference":
        return REFERENCE_BACKEND
    if name == "torch":
        return GroupedAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":  # its C kernel takes the addresses of the pool and the tables
            raise ValueError(
                f'attention_backend="cpu" runs on the CPU alone (its C kernel reads CPU memory); on {device.type!r} '
                'use "triton" or "torch"'
            )
        return CpuAttentionBackend()
    check_triton_runs(device)
    from .backends import triton_attn  # imports Triton: only when it is asked for

    return StatelessBackend("triton", triton_attn.store_kv, triton_attn.paged_attention)


def check_triton_runs(device: torch.device) -> None:
    """A one-line ValueError unless the "triton" backend can run on `device` here: Triton must be installed
    (it has wheels for Linux only), and the device must be CUDA or Triton's interpreter must be on."""
    try:
        installed = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # an import system that refuses it, or a module without a spec
        installed = False
    if not installed:
        raise ValueError(
            f"Triton is not installed ({platform.system()} here; it has wheels for Linux only): "
            'use attention_backend="torch"'
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f'attention_backend="triton" on device {device.type!r} runs only in Triton\'s interpreter: set '
            "TRITON_INTERPRET=1 in the environment before rosellm's kernels are imported (it is slow: for "
            'tests and learning), or use attention_backend="torch"'
        )
