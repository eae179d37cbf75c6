"""integer_dot.c's kernel as a torch operator written in C++ (integer_dot_op.cpp), for compiled graphs.

A compiled one-token step calls a quantized layer's kernel 4 times a decoder layer. Through a Python operator
(`quantized_linear.OPERATORS`) each call leaves the graph's code for Python and comes back: measured on a 2-core
AMD EPYC with AVX2, 54 us a call on a 576x576 layer where the kernel itself takes 18, about 4 ms of a 25 ms
step. An operator whose implementation is C++, registered with torch's dispatcher by `TORCH_LIBRARY`, is called
by the graph as torch's own are: 24 us. It does no arithmetic of its own: it calls the C kernel (built per CPU
level by c_kernels.py, as before) through the address of its `linear`, an int the graph holds.

It is compiled once per machine, torch version and package copy, with $CXX (else g++; Inductor needs a C++
compiler on the CPU already) against the headers torch ships, into rosellm's cache; a build takes about 12 s.
Where it cannot be built (no compiler, a platform whose linker wants other flags) `operator` is None and the
graph keeps the Python operator.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ...envs import cache_dir

SOURCE = Path(__file__).with_name("integer_dot_op.cpp")
STANDARDS = ("-std=c++20", "-std=c++17")  # torch's headers want C++17 at least; the first a compiler takes
_loading = threading.Lock()  # `operator`'s: one build and registration at a time


def _output(x, codes, *rest):
    return x.new_empty(x.shape[0], codes.shape[0])


def operator(package: str):
    """The operator `integer_dot_linear(x, codes, scales, minimums, bias, kernel) -> out` of the namespace made
    from `package` (the caller's `__package__`), built and loaded once per process; None where it cannot be.
    Under a lock: two threads preparing models at once must not register the operator twice."""
    with _loading:
        return _operator(package)


@functools.cache
def _operator(package: str):
    namespace = package.replace(".", "_")
    library = build(namespace)
    if library is None:
        return None
    try:
        torch.ops.load_library(str(library))
    except OSError:  # built, but not loadable here
        return None
    torch.library.register_fake(f"{namespace}::integer_dot_linear", _output)
    return getattr(torch.ops, namespace).integer_dot_linear.default


def address(library: ctypes.CDLL) -> int:
    """The address of the C kernel's `linear` in `library`: the operator's `kernel` argument."""
    return ctypes.cast(library.linear, ctypes.c_void_p).value


def build(namespace: str) -> Path | None:
    """integer_dot_op.cpp compiled for `namespace` into the cache (once: its path holds a hash of what the build
    depends on); None where no C++ compiler builds it."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    torch_dir = Path(torch.__file__).parent
    flags = [
        f"-DNAMESPACE={namespace}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-I{torch_dir / 'include'}",
        *("-O2", "-fPIC", "-shared", "-w"),
    ]
    libraries = [
        f"-L{torch_dir / 'lib'}",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-ltorch_cpu",
        "-lc10",
    ]  # after the source
    described = [SOURCE.read_text(), torch.__version__, cxx, *flags, *libraries]
    key = hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"integer_dot_op-{namespace}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.stem}-") as work:
        partial = Path(work) / "op.so"
        for standard in STANDARDS:
            if subprocess.run(
                [cxx, standard, *flags, str(SOURCE), *libraries, "-o", str(partial)], capture_output=True
            ).returncode:
                continue
            os.replace(partial, target)  # the first of several builds at once to finish puts its library in place
            return target
    return None
