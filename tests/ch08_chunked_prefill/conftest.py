"""The Triton kernels of this chapter's tests run in Triton's interpreter on a machine without CUDA: as in
chapter 06's tests, TRITON_INTERPRET=1 must be set before the kernels are first imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
