"""Chapter 06's kernels on a machine without CUDA run in Triton's interpreter.

`triton.jit` decides between compiling and interpreting when it decorates a kernel, that is when
`rosellm.kernels` is first imported, so TRITON_INTERPRET=1 must be in the environment before that: here,
before any test module of this folder is collected. (rosellm imports the kernels only when the "triton"
backend is asked for, so the other chapters' tests never import Triton.)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
