"""C kernels of the package, compiled on first use with the machine's C compiler and called through ctypes.

Inductor needs a C compiler on the CPU already (it compiles the C++ it writes), so a kernel written by hand
needs no other tool: its source ships beside this file (or beside the module that uses it, which names its
folder), is compiled once per machine and per set of constants into rosellm's cache, and is loaded with
ctypes. The constants are the model's shapes (the compiler unrolls the loops over them). The code is compiled
for this CPU (`-march=native`; `-mcpu=native` on ARM, where GCC and Apple's clang mean something else by
`-march`), or for the level ROSELLM_CPU_FEATURES names (platforms/cpu_features.py), and the cache key holds the
level, the flags and the CPU's flags: a cache shared by machines or levels that differ never hands one's code to
the other. Where no compiler works, or at level "nocc", `load` returns None and the caller keeps its PyTorch
path.

A build's outcome, a library or a failure, is kept for the process per kernel, constants, compiler ($CC),
level and cache folder: a failed build is not tried again on every step, and setting another compiler, level
or cache folder tries again. (A compiler installed on the PATH while the process runs is not seen.) Each
build writes into a temporary folder of its own, so threads and processes building at once never share a
file, and the first to finish puts its library in place; a build also removes from the cache what no
process has loaded for `MAX_AGE_DAYS`.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ...envs import cache_dir
from ...platforms import cpu_features

# What each level of cpu_features adds on x86-64 to the architecture alone (-march=x86-64); every level
# has the flags of those below it.
X86_LEVEL_FLAGS = {
    "avx2": ("-mavx2", "-mfma"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),  # every CPU with AVX-512 BF16 has VNNI (int8 dot products)
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
MAX_AGE_DAYS = 30

_outcomes: dict[tuple, ctypes.CDLL | None] = {}  # see `load`
_building = threading.Lock()


def architecture(machine: str) -> str:
    """platform.machine()'s name -> "x86_64", "aarch64" or itself (Linux, macOS and Windows differ)."""
    return {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}.get(
        machine.lower(), machine
    )


def target_flags(machine: str, level: str, masked: bool) -> tuple[str, ...]:
    """The flags that say which CPU the code runs on: this one (`masked` False), or any CPU of `level`."""
    arch = architecture(machine)
    if not masked:
        return {"x86_64": ("-march=native",), "aarch64": ("-mcpu=native",)}.get(arch, ())
    if arch == "x86_64":
        below = cpu_features.LEVELS[: cpu_features.LEVELS.index(level) + 1]
        return ("-march=x86-64", *(flag for name in below for flag in X86_LEVEL_FLAGS.get(name, ())))
    if arch == "aarch64":
        return ("-march=armv8-a",)  # baseline: the one level an ARM CPU has here
    return ()


def flag_sets(machine: str, compiler_kind: str, level: str, masked: bool) -> list[tuple[str, ...]]:
    """The flag sets to try in order: the first that compiles wins. -ffast-math lets the compiler reorder sums
    into vector lanes and call vector exp; it is given to the compile step only: linked with it, the library
    would switch the whole process to flushing subnormal numbers to zero when loaded (crtfastmath), and
    change every other computation's results. Apple's clang has no -fopenmp: one thread there."""
    openmp = () if compiler_kind == "apple-clang" else ("-fopenmp",)
    tries = [
        ("-O3", *target_flags(machine, level, masked), "-ffast-math", *openmp),
        ("-O3", "-ffast-math", *openmp),  # a compiler that refuses the target flags: its default target
        ("-O3", "-ffast-math"),
    ]
    return list(dict.fromkeys(tries))


def compiler() -> str | None:
    """The C compiler: $CC, else the first of cc, gcc and clang on the PATH; None where none is found, or at
    level "nocc"."""
    if cpu_features.level() == "nocc":
        return None
    named = os.environ.get("CC")
    return next(filter(None, map(_find, (named,) if named else ("cc", "gcc", "clang"))), None)


@functools.cache
def _find(program: str) -> str | None:
    return shutil.which(program)


@functools.cache
def compiler_kind(cc: str) -> str:
    """The kind of compiler `cc` is, from what `cc --version` says: "gcc", "clang" or "apple-clang"."""
    try:
        said = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "gcc"
    return "apple-clang" if "Apple clang" in said else "clang" if "clang" in said else "gcc"


def cpu_description() -> str:
    """What the code is compiled for: the machine, and the CPU's flags where Linux lists them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def setting() -> tuple[str | None, ...]:
    """What a build depends on that can change while the process runs: $CC, the level, the cache folder."""
    return tuple(os.environ.get(name) for name in ("CC", cpu_features.VARIABLE, "ROSELLM_CACHE"))


def load(name: str, folder: Path | None = None, **defines: str | int) -> ctypes.CDLL | None:
    """`name`.c of `folder` (None: this file's) compiled with `defines` (-DKEY=VALUE), loaded; None where it
    cannot be (no compiler, a compiler that fails, a cache that cannot be written). Built once per `setting()`."""
    key = (name, folder, tuple(sorted(defines.items())), setting())
    with _building:
        if key not in _outcomes:
            _outcomes[key] = library(name, defines, folder)
        return _outcomes[key]


def library(name: str, defines: dict, folder: Path | None = None) -> ctypes.CDLL | None:
    """`load` without keeping the outcome: the library from the cache folder, or built into it."""
    cc, source = compiler(), (folder or Path(__file__).parent) / f"{name}.c"
    if cc is None:
        return None
    level, masked = cpu_features.level(), cpu_features.masked()
    tries = flag_sets(platform.machine(), compiler_kind(cc), level, masked)
    macros = [f"-D{key}={value}" for key, value in sorted(defines.items())]
    described = [source.read_text(), *macros, cpu_description(), cc, level, repr(tries)]
    key = hashlib.sha256("\n".join(described).encode()).hexdigest()
    target = cache_dir() / "kernels" / f"{name}-{level if masked else 'native'}-{key[:16]}.so"
    try:
        if target.exists():
            os.utime(target)  # used now: see `prune`
        elif not build(cc, source, macros, tries, target):
            return None
        return ctypes.CDLL(str(target))
    except OSError:
        return None


def build(cc: str, source: Path, macros: list[str], tries: list[tuple[str, ...]], target: Path) -> bool:
    """Compile `source` into the shared library `target`, with the first flag set of `tries` that works."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.stem}-") as work:
        objects, partial = Path(work) / "kernel.o", Path(work) / "kernel.so"
        for flags in tries:
            compile_step = [cc, *flags, "-fPIC", *macros, "-c", str(source), "-o", str(objects)]
            link = [cc, *(f for f in flags if f == "-fopenmp"), "-shared", str(objects), "-o", str(partial), "-lm"]
            if all(subprocess.run(step, capture_output=True).returncode == 0 for step in (compile_step, link)):
                os.replace(partial, target)
                prune(target.parent)
                return True
    return False


def prune(folder: Path) -> None:
    """Remove what no process has loaded (or a build has left) for MAX_AGE_DAYS: libraries of other shapes,
    levels or versions of a kernel, and the folders of builds that were killed."""
    oldest = time.time() - MAX_AGE_DAYS * 86400
    for path in folder.iterdir():
        try:
            if path.stat().st_mtime >= oldest:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:  # another process removed it first, or it cannot be removed: leave it
            pass
