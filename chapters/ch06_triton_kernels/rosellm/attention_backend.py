"""Which functions write and read the paged KV pool: the PyTorch reference or the Triton kernels.

Both have the same two functions with the same contract:
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, metadata) -> output
"""

import importlib.util
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import paged_attention

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable
    paged_attention: Callable


TORCH_BACKEND = AttentionBackend("torch", paged_attention.store_kv, paged_attention.paged_attention)


def get_attention_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """name: "torch", "triton", or None ("triton" on CUDA, "torch" elsewhere)."""
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
    if name == "torch":
        return TORCH_BACKEND
    check_triton_runs(device)
    from . import kernels  # imports Triton: only when it is asked for

    return AttentionBackend("triton", kernels.store_kv, kernels.paged_attention)


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
