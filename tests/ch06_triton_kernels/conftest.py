"""Chapter 06's tests need Triton; on a machine without CUDA its kernels run in Triton's interpreter.

Triton has wheels for Linux only: where it cannot be imported, every test of this folder is skipped, with
that reason (`tests/needs_triton.py`).

`triton.jit` decides between compiling and interpreting when it decorates a kernel, that is when
`rosellm.kernels` is first imported, so TRITON_INTERPRET=1 must be in the environment before that: here,
before any test module of this folder is collected. (rosellm imports the kernels only when the "triton"
backend is asked for, so the other chapters' tests never import Triton.)
"""

import os

import pytest
import torch

from tests.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def triton_installed():
    if TRITON_MISSING:
        pytest.skip(TRITON_MISSING)
