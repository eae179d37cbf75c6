"""Attention backends: the grouped PyTorch one, the CPU one, the Triton one."""
