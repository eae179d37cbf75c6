"""Shared fixtures: chapter checkpoints, tiny random Llama models with their Hugging Face twins, SmolLM2.

The `checkpoint` fixture is what keeps old lessons true: a test in `tests/chNN_slug/` runs against
chapter NN's checkpoint and every later one (the frozen copies under `chapters/` and `rosellm/`).
A test module about a structure that a later chapter replaces sets `LAST_CHAPTER = k`.
"""

import importlib
import re
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TINY_CONFIGS, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def chapter_number(name: str) -> int:
    return int(re.match(r"ch(\d\d)_", name).group(1))


def all_checkpoints() -> list[tuple[int, str]]:
    """(chapter number, module name) for each frozen chapter and for `rosellm/` (the latest)."""
    found = [
        (chapter_number(path.parent.name), f"chapters.{path.parent.name}.rosellm")
        for path in sorted(ROOT.glob("chapters/ch[0-9][0-9]_*/rosellm"))
    ]
    latest = re.search(r'__chapter__ = "(\d\d)_', (ROOT / "rosellm" / "__init__.py").read_text())
    found.append((int(latest.group(1)), "rosellm"))
    return found


def pytest_generate_tests(metafunc):
    if "checkpoint" not in metafunc.fixturenames:
        return
    test_dir = Path(metafunc.definition.path).parent.name
    first = chapter_number(test_dir)
    # A test of a structure that a later chapter replaces says where it stops holding.
    last = getattr(metafunc.module, "LAST_CHAPTER", 99)
    chosen = [(n, module) for n, module in all_checkpoints() if first <= n <= last]
    ids = [f"ch{n:02d}" for n, _ in chosen]
    metafunc.parametrize("checkpoint", [module for _, module in chosen], ids=ids, indirect=True)


@pytest.fixture
def checkpoint(request):
    """The package of one chapter checkpoint, e.g. `chapters.ch01_naive_decode.rosellm`."""
    return importlib.import_module(request.param)


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
    from rosellm.loader import bundled_model_path

    try:
        return bundled_model_path()
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
def smollm2_llm(checkpoint, smollm2_path):
    """`checkpoint.LLM()` on the bundled SmolLM2, built once per checkpoint."""
    if checkpoint.__name__ not in _smollm2_llms:
        _smollm2_llms[checkpoint.__name__] = checkpoint.LLM()
    return _smollm2_llms[checkpoint.__name__]
