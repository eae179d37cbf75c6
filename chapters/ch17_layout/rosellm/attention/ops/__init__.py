"""Functions of tensors: the PyTorch reference, the Triton kernels, the C kernel and its builder."""
