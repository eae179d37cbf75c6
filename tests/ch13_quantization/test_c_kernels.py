"""How a C kernel is built (c_kernels.py): the flags for each machine, compiler and CPU level; a failed build
tried again only when what it depends on changes; builds at once that never share a file; a cache that
forgets what has not been used for a month; the compiled tensor algebra where no build works."""

import os
import threading
import time

import pytest
import torch

from tests.ch05_paged_attention.paged_data import make_problem

pytestmark = [pytest.mark.requires("quantization"), pytest.mark.cpu_features]

OPENMP, FAST = ("-fopenmp",), ("-O3", "-ffast-math")
AVX2 = ("-march=x86-64", "-mavx2", "-mfma")
AVX512 = (*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")

# (platform.machine(), compiler, level, masked) -> the first flag set tried. No ARM machine runs these tests:
# the table is what pins ARM's flags (Apple's clang, and older clang and GCC on aarch64, refuse -march=native
# and take -mcpu=native; Apple's clang refuses -mcpu on x86), and the fallbacks are what a refused flag leads to.
FIRST_FLAGS = [
    ("x86_64", "gcc", "avx512_bf16", False, ("-O3", "-march=native", "-ffast-math", *OPENMP)),
    ("AMD64", "clang", "avx2", False, ("-O3", "-march=native", "-ffast-math", *OPENMP)),
    ("x86_64", "apple-clang", "avx2", False, ("-O3", "-march=native", "-ffast-math")),  # an Intel Mac
    ("x86_64", "gcc", "baseline", True, ("-O3", "-march=x86-64", "-ffast-math", *OPENMP)),
    ("x86_64", "clang", "avx2", True, ("-O3", *AVX2, "-ffast-math", *OPENMP)),
    ("x86_64", "gcc", "avx512", True, ("-O3", *AVX512, "-ffast-math", *OPENMP)),
    ("x86_64", "gcc", "avx512_bf16", True, ("-O3", *AVX512, "-mavx512bf16", "-ffast-math", *OPENMP)),
    (
        "x86_64",
        "gcc",
        "amx",
        True,
        ("-O3", *AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-ffast-math", *OPENMP),
    ),
    ("aarch64", "gcc", "baseline", False, ("-O3", "-mcpu=native", "-ffast-math", *OPENMP)),
    ("aarch64", "clang", "baseline", False, ("-O3", "-mcpu=native", "-ffast-math", *OPENMP)),
    ("arm64", "apple-clang", "baseline", False, ("-O3", "-mcpu=native", "-ffast-math")),
    ("arm64", "apple-clang", "baseline", True, ("-O3", "-march=armv8-a", "-ffast-math")),
    ("aarch64", "gcc", "baseline", True, ("-O3", "-march=armv8-a", "-ffast-math", *OPENMP)),
    ("ppc64le", "gcc", "baseline", False, ("-O3", "-ffast-math", *OPENMP)),
]


@pytest.mark.parametrize("machine, compiler, level, masked, first", FIRST_FLAGS)
def test_flags_for_each_machine_compiler_and_level(checkpoint, machine, compiler, level, masked, first):
    if "integer_dot" in checkpoint.__capabilities__ and "-mavx512bf16" in first:  # chapter 18: and VNNI's int8 dots
        at = first.index("-mavx512bf16") + 1
        first = (*first[:at], "-mavx512vnni", *first[at:])
    tries = checkpoint.c_kernels.flag_sets(machine, compiler, level, masked)
    assert tries[0] == first
    assert tries[-1] == FAST  # what every C compiler takes: no target, one thread
    assert len(set(tries)) == len(tries) and all(t[0] == "-O3" and "-ffast-math" in t for t in tries)


def counted_compiles(checkpoint, monkeypatch) -> list:
    """The compile steps c_kernels runs from now on (each a command line)."""
    compiles, run = [], checkpoint.c_kernels.subprocess.run

    def counting(args, **kwargs):
        if "-c" in args:
            compiles.append(args)
        return run(args, **kwargs)

    monkeypatch.setattr(checkpoint.c_kernels.subprocess, "run", counting)
    return compiles


SHAPES = dict(SCALAR="float", BF16=0, HEAD_DIM=16, GROUP=2, KV_HEADS=2, BLOCK_SIZE=4)


def test_compiled_once_per_shapes_into_the_cache_and_none_where_it_cannot_be(checkpoint, tmp_path, monkeypatch):
    def load(**changed):  # what the process has not kept: every call looks at the disk
        return checkpoint.c_kernels.library("decode_attention", SHAPES | changed)

    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    compiles = counted_compiles(checkpoint, monkeypatch)
    assert load() is not None
    built = sorted((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and len(compiles) == 1
    assert load() is not None and len(compiles) == 1  # not rebuilt
    assert load(BLOCK_SIZE=8) is not None
    assert len(list((tmp_path / "kernels").iterdir())) == 2  # other shapes, another library
    monkeypatch.setenv("CC", "false")  # a compiler that fails whatever it is given
    assert load(BLOCK_SIZE=2) is None
    assert len(list((tmp_path / "kernels").iterdir())) == 2  # and leaves nothing behind
    monkeypatch.delenv("CC")
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    monkeypatch.setenv("ROSELLM_CACHE", str(unwritable))  # its kernels folder cannot be made
    assert load(BLOCK_SIZE=2) is None


def test_a_failed_build_is_tried_again_only_when_its_compiler_changes(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails whatever it is given
    compiles = counted_compiles(checkpoint, monkeypatch)
    assert checkpoint.c_kernels.load("decode_attention", **SHAPES) is None
    tried = len(compiles)
    assert tried > 0 and checkpoint.c_kernels.load("decode_attention", **SHAPES) is None
    assert len(compiles) == tried  # the same failure is not paid for again, step after step
    monkeypatch.delenv("CC")
    assert checkpoint.c_kernels.load("decode_attention", **SHAPES) is not None  # another compiler: built


def test_a_build_that_fails_leaves_the_compiled_tensor_algebra(checkpoint, tmp_path, monkeypatch):
    """What an ARM machine whose compiler refuses every flag set gets: the same numbers, compiled."""
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    query, key_cache, value_cache, metadata, _, _ = make_problem(checkpoint, [9, 1, 20], [1, 1, 1], 4, 4, 2, 16)
    tables, lens = metadata.block_tables.clamp(min=0).long(), metadata.seq_lens.long()
    out = checkpoint.cpu_attention.kernel_decode_attention(query, key_cache, value_cache, tables, lens)
    expected = checkpoint.cpu_attention.compiled_decode_attention(query, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_threads_loading_at_once_build_once_and_share_no_file(checkpoint, tmp_path, monkeypatch):
    """Two threads ask for the same new library at once (each compile slowed down, so that they overlap):
    no two compile steps write the same object file, and both threads get the library."""
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    objects, run = [], checkpoint.c_kernels.subprocess.run

    def slow(args, **kwargs):
        if "-c" in args:
            objects.append(args[args.index("-o") + 1])
            time.sleep(0.5)
        return run(args, **kwargs)

    monkeypatch.setattr(checkpoint.c_kernels.subprocess, "run", slow)
    shapes = SHAPES | {"BLOCK_SIZE": 8}
    loaded = []
    threads = [
        threading.Thread(target=lambda: loaded.append(checkpoint.c_kernels.load("decode_attention", **shapes)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loaded) == 2 and all(library is not None for library in loaded)
    assert objects and len(set(objects)) == len(objects)
    assert [path.suffix for path in (tmp_path / "kernels").iterdir()] == [".so"]  # nothing else left


def test_builds_at_once_write_files_of_their_own(checkpoint, tmp_path, monkeypatch):
    """Two builds of one library at once (two processes, or threads outside `load`): each compiles and links
    in a folder of its own, so neither removes the other's object; one library is left in place."""
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    together, outputs, run = threading.Barrier(2, timeout=60), [], checkpoint.c_kernels.subprocess.run

    def compile_together(args, **kwargs):
        if "-c" in args and len(outputs) < 2:
            outputs.append(args[args.index("-o") + 1])
            together.wait()  # both have chosen their object file before either compiles
        return run(args, **kwargs)

    monkeypatch.setattr(checkpoint.c_kernels.subprocess, "run", compile_together)
    shapes = SHAPES | {"BLOCK_SIZE": 2}
    built = []
    threads = [
        threading.Thread(target=lambda: built.append(checkpoint.c_kernels.library("decode_attention", shapes)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(outputs)) == 2 and len(built) == 2 and all(library is not None for library in built)
    assert [path.suffix for path in (tmp_path / "kernels").iterdir()] == [".so"]


def test_a_build_removes_what_has_not_been_used_for_a_month(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    kernels, month = tmp_path / "kernels", checkpoint.c_kernels.MAX_AGE_DAYS * 86400
    assert checkpoint.c_kernels.library("decode_attention", SHAPES) is not None
    [in_use] = kernels.iterdir()
    stale, recent, killed = kernels / "decode_attention-avx2-0123.so", kernels / "other-4567.so", kernels / ".x-1"
    stale.write_text(""), recent.write_text(""), killed.mkdir()
    now = time.time()
    for path, age in ((stale, month + 60), (recent, month - 3600), (killed, month + 60), (in_use, month + 60)):
        os.utime(path, (now - age, now - age))
    assert checkpoint.c_kernels.library("decode_attention", SHAPES) is not None  # loaded: used now
    assert checkpoint.c_kernels.library("decode_attention", SHAPES | {"BLOCK_SIZE": 16}) is not None  # a build
    assert not stale.exists() and not killed.exists()
    assert recent.exists() and in_use.exists() and len(list(kernels.iterdir())) == 3
