"""The chapter checkpoints: the frozen `chapters/chNN_slug/rosellm/` packages, then `rosellm/` (the latest).

Tests, benchmarks and the docs find checkpoints here and ask them what they can do by name (a capability
each checkpoint declares in its `__init__.py`), never by probing attributes:

    from chapters import checkpoints, checkpoint, latest
    for point in checkpoints():
        if "paged" in point.capabilities:
            llm = point.load().LLM(...)

Declarations are read by parsing `__init__.py`, not importing it: listing checkpoints never imports torch.

Chapters 01-16 are flat packages; from chapter 17 on, modules live in subpackages, and a checkpoint's
`__modules__` maps each flat name to its path there. Tests and scripts name a module once, by its flat name:

    loader = submodule(package, "loader")   # package.loader, or package.model_executor.model_loader.loader
    package = Package(point.load())          # package.loader: the same, as an attribute
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
FROZEN_FOLDER = re.compile(r"ch(\d\d)_([a-z0-9_]+)$")
CHAPTER_DECLARATION = re.compile(r"(\d\d)_([a-z0-9_]+)$")
NAME_FORMS = re.compile(r"(?:ch)?(\d{1,2})(?:_([a-z0-9_]+))?$")

# Every capability a checkpoint may declare, and what a checkpoint that declares it can do.
CAPABILITIES = {
    "kv_cache": "keeps keys and values between steps instead of recomputing the prefix",
    "contiguous_cache": "one contiguous KV cache per request (`kv_cache.KVCache`)",
    "batched": "generates many requests together",
    "offline_scheduler": "an offline scheduler of sessions: `LLM.add_request`, `LLM.scheduler.step()`",
    "padded_batch": "merges per-request caches into one padded batch cache each step",
    "block_manager": "fixed-size KV blocks with block tables and reference counts",
    "block_check": "checks at every step that the block tables agree with the real caches",
    "batch_state": "the batch as tensor rows (`batch_state.BatchState`) beside block tables kept by sequence id",
    "sequence_blocks": "each `Sequence` holds its block table; the block manager grows and frees it",
    "chunked_prefill": "prompts split over steps under the token budget (`enable_chunked_prefill`, on by default)",
    "prefix_caching": "full KV blocks cached by the hash chain of their tokens (`enable_prefix_caching`)",
    "parallel_sampling": "`SamplingParams(n=...)`: n answers sharing the prompt's blocks, copy on write",
    "paged": "one paged KV pool per layer, attention through block tables",
    "triton_kernels": "Triton kernels for GPU, chosen by `attention_backend`",
    "step_engine": "the step-level `LLMEngine` (add_request / step / abort_request), options named as vLLM's",
    "preemption": "a scheduler with waiting and running queues and budgets, which preempts by recomputation",
    "serving": "an async engine loop, stop strings, an OpenAI-compatible server (`python -m rosellm serve`)",
    "compiled": "fused QKV and gate-up, decoder layers compiled by torch.compile (`enforce_eager` turns it off)",
    "tensor_parallel": "`tensor_parallel_size`: each layer split over processes (rank 0 runs the engine)",
    "quantization": (
        "weights in fewer bytes: GGUF's own quantized tensors, int8/int4 at load, bf16 (`quantization`, `dtype`)"
    ),
    "speculative_decoding": (
        "`speculative_config`: tokens proposed cheaply (n-gram, a draft model) and verified in one step, exactly"
    ),
    "structured_outputs": (
        "`SamplingParams(structured_outputs=...)`: a JSON schema, regex, choice or grammar masks the logits"
    ),
    "engine_core": (
        "`AsyncLLM`: the engine in engine-core processes behind a front end (ZeroMQ), data-parallel replicas"
    ),
    "subpackages": (
        "modules in subpackages that mirror vLLM's, in layers that import one way (`__layers__`, `__modules__`)"
    ),
    "integer_dot": (
        "GGUF's 4- and 8-bit weights on fp32 activations: few rows quantized to 8 bits per block of 32 and "
        "multiplied in integer dot products by a C kernel per CPU level (`int8_activations`)"
    ),
}


@dataclass(frozen=True)
class Checkpoint:
    """One chapter's package: where it is, how to import it, what it declares it can do."""

    number: int
    slug: str
    name: str
    module: str
    path: Path
    capabilities: frozenset[str]
    renames: tuple[tuple[str, str], ...] = ()  # (flat module name, its dotted path here) from `__modules__`

    def load(self) -> ModuleType:
        """Import the package (this imports torch)."""
        return importlib.import_module(self.module)

    def module_path(self, flat: str) -> str:
        """The dotted path inside this package of the module chapters 01-16 call `flat` (e.g. "loader")."""
        return dict(self.renames).get(flat, flat)

    def file_path(self, flat: str) -> str:
        """Where the file a flat chapter has at `flat` (e.g. "loader.py", "kernels/store_kv.py") is in this
        package: a module by `module_path`; any other file (a C source) beside the one of its name."""
        if not self.renames:
            return flat
        if flat.endswith(".py"):
            name = flat.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            if name == "__init__":
                return flat
            path = self.module_path(name).replace(".", "/")
            return f"{path}/__init__.py" if (self.path / path).is_dir() else f"{path}.py"
        found = sorted(self.path.rglob(Path(flat).name))
        return found[0].relative_to(self.path).as_posix() if len(found) == 1 else flat


def assignments(init_file: Path) -> dict[str, ast.expr]:
    """The top-level `NAME = value` statements of a package's `__init__.py`."""
    found: dict[str, ast.expr] = {}
    for node in ast.parse(init_file.read_text(), filename=str(init_file)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def read_renames(init_file: Path) -> tuple[tuple[str, str], ...]:
    """`__modules__` of a package's `__init__.py` (flat name -> dotted path), parsed; () where it is flat."""
    declared = assignments(init_file).get("__modules__")
    return () if declared is None else tuple(sorted(ast.literal_eval(declared).items()))


def read_declarations(init_file: Path) -> tuple[str, frozenset[str]]:
    """`__chapter__` and `__capabilities__` of a package's `__init__.py`, parsed without importing it."""
    found = assignments(init_file)
    if "__chapter__" not in found:
        raise ValueError(f'{init_file} declares no __chapter__ = "NN_slug"')
    chapter = ast.literal_eval(found["__chapter__"])
    declared = found.get("__capabilities__")
    if declared is None:
        return chapter, frozenset()
    if isinstance(declared, ast.Call) and isinstance(declared.func, ast.Name) and declared.func.id == "frozenset":
        capabilities = frozenset(ast.literal_eval(declared.args[0])) if declared.args else frozenset()
    else:
        capabilities = frozenset(ast.literal_eval(declared))
    unknown = capabilities - CAPABILITIES.keys()
    if unknown:
        raise ValueError(f"{init_file} declares unknown capabilities {sorted(unknown)}; known: {sorted(CAPABILITIES)}")
    return chapter, capabilities


def load_checkpoint(package: Path, module: str) -> Checkpoint:
    chapter, capabilities = read_declarations(package / "__init__.py")
    match = CHAPTER_DECLARATION.match(chapter)
    if not match:
        raise ValueError(f'{package}/__init__.py: __chapter__ = "{chapter}" is not "NN_slug"')
    number, slug = int(match.group(1)), match.group(2)
    renames = read_renames(package / "__init__.py")
    return Checkpoint(number, slug, f"ch{number:02d}_{slug}", module, package, capabilities, renames)


def checkpoints() -> list[Checkpoint]:
    """Every checkpoint in chapter order, `rosellm/` (the latest) last."""
    found = []
    for folder in sorted((ROOT / "chapters").glob("ch[0-9][0-9]_*")):
        if FROZEN_FOLDER.match(folder.name) and (folder / "rosellm" / "__init__.py").is_file():
            point = load_checkpoint(folder / "rosellm", f"chapters.{folder.name}.rosellm")
            if point.name != folder.name:
                raise ValueError(f"chapters/{folder.name}/rosellm declares chapter {point.name}")
            found.append(point)
    found.append(load_checkpoint(ROOT / "rosellm", "rosellm"))
    numbers = [point.number for point in found]
    if numbers != list(range(1, len(found) + 1)):
        raise ValueError(f"checkpoints must be chapters 1..N in order, rosellm/ last; found {numbers}")
    return found


def checkpoint(number_or_name: int | str) -> Checkpoint:
    """The checkpoint of a chapter, named 7, "07", "ch07" or "ch07_continuous_batching"."""
    text = str(number_or_name)
    match = NAME_FORMS.match(text)
    if isinstance(number_or_name, bool) or not match:
        raise ValueError(f"{number_or_name!r} names no chapter (say 7, '07', 'ch07' or 'ch07_slug')")
    number, slug = int(match.group(1)), match.group(2)
    for point in checkpoints():
        if point.number == number and slug in (None, point.slug):
            return point
    known = ", ".join(point.name for point in checkpoints())
    raise ValueError(f"no checkpoint {number_or_name!r}; there are: {known}")


def latest() -> Checkpoint:
    """The checkpoint of the latest chapter: `rosellm/` itself."""
    return checkpoints()[-1]


def submodule(package: ModuleType | str, flat: str) -> ModuleType:
    """The module chapters 01-16 call `flat` (e.g. "loader", "kernels.store_kv"), imported from `package` (a
    checkpoint's package, a `Package`, or its name) at its path there: its `__modules__`, else flat."""
    if isinstance(package, str):
        package = importlib.import_module(package)
    return importlib.import_module(f"{package.__name__}.{getattr(package, '__modules__', {}).get(flat, flat)}")


class Package:
    """A checkpoint's package whose attributes are also its modules by their flat names: `Package(p).loader`
    is `submodule(p, "loader")` in every chapter; any other attribute is the package's own."""

    def __init__(self, package: ModuleType):
        self.__name__ = package.__name__
        self.package = package

    def __getattr__(self, name: str):
        path = getattr(self.package, "__modules__", {}).get(name)
        if path is not None:
            return importlib.import_module(f"{self.__name__}.{path}")
        return getattr(self.package, name)

    def __repr__(self) -> str:
        return f"Package({self.__name__})"
