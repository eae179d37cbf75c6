"""The CPU levels of `cpu_features` as a test parameter: ROSELLM_CPU_FEATURES masks the CPU down to each.

Every level up to this CPU's own runs. A mask only takes away, so a level above this CPU's cannot be run
here: it is reported as an xfail that names both levels (never as a pass); on a CPU with AMX every level runs.
"""

import pytest

from chapters import submodule

cpu_features = submodule("rosellm", "cpu_features")

VARIABLE = cpu_features.VARIABLE
LEVELS = cpu_features.LEVELS
NATIVE = cpu_features.native_level()
NATIVE_BF16 = ("avx512_bf16", "amx")  # the levels whose CPUs multiply bf16 natively


def levels(*names: str) -> list:
    """One pytest parameter per level of `names` (every level when none is named), with its name as id."""
    return [pytest.param(name, id=name, marks=above_this_cpu(name)) for name in names or LEVELS]


def above_this_cpu(name: str) -> tuple:
    if LEVELS.index(name) <= LEVELS.index(NATIVE):
        return ()
    return (pytest.mark.xfail(run=False, reason=f"this CPU's level is {NATIVE}: a mask cannot raise it to {name}"),)
