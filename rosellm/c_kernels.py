"""C kernels of the package, compiled on first use with the machine's C compiler and called through ctypes.

Inductor needs a C compiler on the CPU already (it compiles the C++ it writes), so a kernel written by hand
needs no other tool: its source ships beside this file, is compiled once per machine and per set of
constants into rosellm's cache, and is loaded with ctypes. The constants are the model's shapes (the
compiler unrolls the loops over them), and the cache key holds the CPU's flags too: the code is compiled for
this CPU (`-march=native`), and a cache shared by machines that differ must not hand one's code to the
other. Where no compiler works, `load` returns None and the caller keeps its PyTorch path.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

# Tried in order: the first that compiles wins (Apple's clang has no -fopenmp: one thread there).
# -ffast-math lets the compiler reorder sums into vector lanes and call vector exp; it is given to the
# compile step only: linked with it, the library would switch the whole process to flushing subnormal
# numbers to zero when loaded (crtfastmath), and change every other computation's results.
FLAG_SETS = (
    ("-O3", "-march=native", "-ffast-math", "-fopenmp"),
    ("-O3", "-ffast-math", "-fopenmp"),
    ("-O3", "-ffast-math"),
)


def compiler() -> str | None:
    """The C compiler: $CC, else the first of cc, gcc and clang on the PATH."""
    return os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def cpu_description() -> str:
    """What the code is compiled for: the machine, and the CPU's flags where Linux lists them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


@functools.cache
def load(name: str, **defines: str | int) -> ctypes.CDLL | None:
    """`name`.c of this package compiled with `defines` (-DKEY=VALUE), loaded; None where it cannot be (no
    compiler, a compiler that fails, a cache that cannot be written)."""
    from .loader import cache_dir  # here: the loader imports the model, whose attention imports us

    cc, source = compiler(), Path(__file__).with_name(f"{name}.c")
    if cc is None:
        return None
    macros = [f"-D{key}={value}" for key, value in sorted(defines.items())]
    key = hashlib.sha256("\n".join([source.read_text(), *macros, cpu_description(), cc]).encode()).hexdigest()
    target = cache_dir() / "kernels" / f"{name}-{key[:16]}.so"
    try:
        if not target.exists() and not build(cc, source, macros, target):
            return None
        return ctypes.CDLL(str(target))
    except OSError:
        return None


def build(cc: str, source: Path, macros: list[str], target: Path) -> bool:
    """Compile `source` into the shared library `target`, with the first flag set that works."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}")  # processes compiling at once each write their own
    objects = target.with_name(f"{target.name}.{os.getpid()}.o")
    try:
        for flags in FLAG_SETS:
            compile_step = [cc, *flags, "-fPIC", *macros, "-c", str(source), "-o", str(objects)]
            link = [cc, *(f for f in flags if f == "-fopenmp"), "-shared", str(objects), "-o", str(partial), "-lm"]
            if all(subprocess.run(step, capture_output=True).returncode == 0 for step in (compile_step, link)):
                os.replace(partial, target)
                return True
        return False
    finally:  # whatever a failed step left
        objects.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
