"""Shared fixtures: chapter checkpoints, tiny random Llama models with their Hugging Face twins, SmolLM2.

The `checkpoint` fixture is what keeps old lessons true. A test in `tests/chNN_slug/` runs against chapter
NN's checkpoint and the latest (`rosellm/`): what a chapter taught must still hold at the end of the book.
With `--all-checkpoints` (`make test-all`) it runs on every checkpoint in between too (the frozen copies
under `chapters/`). Frozen copies change only by a forward fix, after which `make test-all` is the check;
so each chapter adds a fixed cost to `make test`, not one that grows with the number of chapters.

A test that needs something a checkpoint declares (`__capabilities__` in its `__init__.py`, the names in
`chapters.CAPABILITIES`) says so with `@pytest.mark.requires("paged", ...)`: checkpoints without it are
not parametrized at all (a test of a structure that a later chapter replaces ends where it goes).

A costly test of code that later chapters carry unchanged is marked `latest_only`: `make test` runs it on
the latest checkpoint alone (at a chapter's tag, that chapter's own), `make test-all` on every one.

`make test` runs the suite on two pytest-xdist workers, which share the CPU's cores (`worker_threads`), then
the tests of the servers and engine-core processes alone (`SERIAL_TEST_DIRS`, marked `serial`).
"""

import functools
import os
import re
from pathlib import Path

import pytest
import torch

import chapters
from tests.tiny_models import TINY_CONFIGS, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
CHAPTER_TEST_DIR = re.compile(r"ch(\d\d)_")
# Their tests start servers and engine cores in processes of their own and wait for answers with deadlines;
# beside another worker's compute those deadlines measure the neighbour, so `make test` runs them alone.
SERIAL_TEST_DIRS = ("ch10_serving", "ch16_engine_core")


def is_serial(test_file: Path) -> bool:
    """Whether `make test` runs this file's tests alone (see `SERIAL_TEST_DIRS`)."""
    return test_file.parent.name in SERIAL_TEST_DIRS


def worker_threads() -> int | None:
    """Under pytest-xdist, each worker's share of the cores (None otherwise): two workers with a thread per
    core each would leave every OpenMP region waiting for a thread the other worker holds."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    return max(1, (os.cpu_count() or 1) // workers) if workers else None


if threads := worker_threads():
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes the tests start
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption(
        "--all-checkpoints",
        action="store_true",
        help="run every test on every checkpoint from its chapter on, not only its own and the latest",
    )


@functools.cache
def all_checkpoints() -> tuple[chapters.Checkpoint, ...]:
    return tuple(chapters.checkpoints())


def checkpoints_for(
    test_dir: str, required: set[str], every: bool, latest_only: bool = False
) -> list[chapters.Checkpoint]:
    """The checkpoints one test of `tests/<test_dir>/` runs against (see the module docstring); a test
    marked `latest_only` runs on the latest alone unless `every`."""
    first = int(CHAPTER_TEST_DIR.match(test_dir).group(1))
    chosen = [point for point in all_checkpoints() if point.number >= first and required <= point.capabilities]
    if not every and len(chosen) > 2:
        chosen = [chosen[0], chosen[-1]]
    if not every and latest_only:
        chosen = chosen[-1:]
    return chosen


def pytest_generate_tests(metafunc):
    if "checkpoint" not in metafunc.fixturenames:
        return
    required = {name for marker in metafunc.definition.iter_markers("requires") for name in marker.args}
    unknown = required - chapters.CAPABILITIES.keys()
    if unknown:
        raise pytest.UsageError(f"{metafunc.definition.nodeid} requires unknown capabilities {sorted(unknown)}")
    chosen = checkpoints_for(
        Path(metafunc.definition.path).parent.name,
        required,
        every=metafunc.config.getoption("--all-checkpoints"),
        latest_only=metafunc.definition.get_closest_marker("latest_only") is not None,
    )
    if not chosen:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: no checkpoint from its chapter on declares {sorted(required)}"
        )
    ids = [f"ch{point.number:02d}" for point in chosen]
    metafunc.parametrize("checkpoint", chosen, ids=ids, indirect=True)


def pytest_collection_modifyitems(config, items):
    """Mark the tests of `SERIAL_TEST_DIRS` `serial`; deselect the tests of benchmark workloads this tree does
    not hold (a chapter tag holds its own)."""
    from benchmarks import WORKLOADS

    for item in items:
        if is_serial(Path(item.path)):
            item.add_marker(pytest.mark.serial)

    latest = all_checkpoints()[-1].number
    present = {name for name, (_, chapter) in WORKLOADS.items() if chapter <= latest}
    absent = [
        item
        for item in items
        if any(name not in present for marker in item.iter_markers("workload") for name in marker.args)
    ]
    if absent:
        config.hook.pytest_deselected(items=absent)
        items[:] = [item for item in items if item not in absent]


@pytest.fixture
def checkpoint(request) -> chapters.Package:
    """The package of one chapter checkpoint, e.g. `chapters.ch01_naive_decode.rosellm`, whose modules are
    named as in chapters 01-16 wherever they live (`checkpoint.loader`; see `chapters.submodule`)."""
    return chapters.Package(request.param.load())


@pytest.fixture
def checkpoint_info(checkpoint, request) -> chapters.Checkpoint:
    """The `chapters.Checkpoint` of the test's `checkpoint`: its number, name and capabilities."""
    return request.node.callspec.params["checkpoint"]


# --- tiny random models -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Hugging Face folders of tiny random Llama models, one per entry of TINY_CONFIGS (seeded)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_hf_models(tiny_model_dirs):
    """The transformers twin of each tiny model: the oracle."""
    from transformers import LlamaForCausalLM

    return {
        name: LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in tiny_model_dirs.items()
    }


# --- SmolLM2 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF; a missing model is a failure (never a skip) naming the install command."""
    from chapters import submodule

    loader = submodule("rosellm", "loader")

    try:
        return loader.model_source(None)
    except FileNotFoundError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own reading of the same GGUF file: the oracle for SmolLM2."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


_smollm2_llms = {}


@pytest.fixture
def smollm2_llm(checkpoint, checkpoint_info, smollm2_path):
    """`checkpoint.LLM()` on the bundled SmolLM2, built once per checkpoint. A frozen checkpoint after chapter 11
    builds it eager: each checkpoint compiles a step of its own (a minute or more with torch.compile's cache
    empty), and their SmolLM2 tests check answers; the compiled step's are chapter 11's and the latest's."""
    if checkpoint.__name__ not in _smollm2_llms:
        eager = 11 < checkpoint_info.number < all_checkpoints()[-1].number
        _smollm2_llms[checkpoint.__name__] = checkpoint.LLM(enforce_eager=True) if eager else checkpoint.LLM()
    return _smollm2_llms[checkpoint.__name__]
