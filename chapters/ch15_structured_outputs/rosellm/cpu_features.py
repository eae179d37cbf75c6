"""What the CPU can do natively, as PyTorch's own CPU detection sees it."""

import torch


def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX-512 BF16 or AMX): there, bf16 weights and activations
    run at twice fp32's speed; elsewhere bf16 is emulated and slower than fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
