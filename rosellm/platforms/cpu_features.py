"""What the CPU can do, as PyTorch's own CPU detection sees it, or less where ROSELLM_CPU_FEATURES says so.

The paths of the engine that depend on the CPU ask here: the compute dtype "auto" picks (`cpu_has_bf16`) and
what the C kernel is compiled for (`level`, read by attention/ops/c_kernels.py). The levels, lowest first:

    nocc          no C compiler: no C kernel is built, and the "cpu" backend compiles nothing (it runs its
                  tensor algebra eagerly)
    baseline      the architecture alone: x86-64 without AVX2, or any ARM CPU (aarch64)
    avx2          AVX2 and FMA
    avx512        AVX-512 (F, BW, DQ, VL), without BF16
    avx512_bf16   AVX-512 with BF16: the first level with native bf16
    amx           AMX tiles (bf16 and int8 matrix units)

`ROSELLM_CPU_FEATURES=avx2` (any level; "none" is "nocc") makes each of those paths run as on a CPU with that
level and no more, so every path runs on any machine. A mask only takes away: a level above this CPU's is
clamped to this CPU's, with a warning. PyTorch's own kernels are not masked by it: they read
ATEN_CPU_CAPABILITY (default, avx2, avx512) when torch starts.
"""

import functools
import logging
import os
from pathlib import Path

import torch

VARIABLE = "ROSELLM_CPU_FEATURES"
LEVELS = ("nocc", "baseline", "avx2", "avx512", "avx512_bf16", "amx")
ALIASES = {"none": "nocc"}

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # messages already logged by `warn_once`


@functools.cache
def native_level() -> str:
    """The highest level this CPU has (x86 only: other architectures are "baseline")."""
    detected = {
        "amx": torch.cpu._is_amx_tile_supported(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "avx512": torch.cpu._is_avx512_supported(),
        "avx2": torch.cpu._is_avx2_supported(),
    }
    return next((name for name, present in detected.items() if present), "baseline")


@functools.cache
def vendor() -> str:
    """The CPU's maker as Linux names it ("GenuineIntel", "AuthenticAMD", ...), or "" where /proc/cpuinfo does
    not say (other systems, ARM). A BLAS may choose its kernels by it: Intel's MKL does."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


def masked() -> bool:
    """Whether ROSELLM_CPU_FEATURES names a level (then code is compiled for that level, not this CPU)."""
    return bool(os.environ.get(VARIABLE, "").strip())


def level() -> str:
    """The level the engine runs at: ROSELLM_CPU_FEATURES's, at most this CPU's; this CPU's when unset."""
    native = native_level()
    if not masked():
        return native
    asked = os.environ[VARIABLE].strip().lower()
    asked = ALIASES.get(asked, asked)
    if asked not in LEVELS:
        raise ValueError(f"{VARIABLE}={os.environ[VARIABLE]!r}: the levels are {', '.join(LEVELS)} (or none)")
    if LEVELS.index(asked) > LEVELS.index(native):
        warn_once(f"{VARIABLE}={asked} asks for more than this CPU has: running at its own level, {native}")
        return native
    return asked


def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX-512 BF16 or AMX, at the level the engine runs at): there,
    bf16 weights and activations run at twice fp32's speed; elsewhere bf16 is emulated and slower than fp32."""
    return LEVELS.index(level()) >= LEVELS.index("avx512_bf16")


def warn_once(message: str) -> None:
    """Log `message` as a warning, the first time only in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
