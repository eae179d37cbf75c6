"""rosellm's weight formats side by side (chapter 13): which to run, how to name them, the bytes a token reads.

    fp32   the fp32 weights, fp32 compute: the path every earlier chapter measured
    bf16   every weight and activation in bfloat16 (`dtype="bfloat16"`)
    int8   weight-only int8, a scale per output channel (`quantization="int8"`)
    int4   weight-only int4 in groups of 32, a scale and a minimum per group (`quantization="int4"`)
    gguf   the GGUF file's own tensors as they are: Q4_1 projections, Q8_0 LM head (`quantization="gguf"`)
    gguf-fp32  the same tensors with fp32 activations (`dtype="float32"`): from chapter 18, 8-bit activations
           and integer dot products at batch 1 on every CPU, where "auto" picks bf16 on a CPU with native bf16
    gguf-exact the same with exact fp32 products (`int8_activations=False`, from chapter 18): the oracle that
           the 8-bit activations of gguf-fp32 are measured against

`BYTES` says how each format's bytes of weights per token are counted.
"""

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    label: str  # after the engine's name: "rosellm (ch13) int4 weights (groups of 32)"
    dtype: str | None  # the engine's dtype; None: its default ("auto")
    quantization: str | None
    int8_activations: bool | None = None  # None: the checkpoint's default (chapter 18's option)

    def engine_options(self) -> dict:
        options = {"quantization": self.quantization} if self.quantization else {}
        return options | ({} if self.int8_activations is None else {"int8_activations": self.int8_activations})


VARIANTS = {
    "fp32": Variant("fp32", "fp32", "float32", None),
    "bf16": Variant("bf16", "bf16", "bfloat16", None),
    "int8": Variant("int8", "int8 weights (per channel)", None, "int8"),
    "int4": Variant("int4", "int4 weights (groups of 32)", None, "int4"),
    "gguf": Variant("gguf", "GGUF Q4_1 tensors as they are", None, "gguf"),
    "gguf-fp32": Variant("gguf-fp32", "GGUF Q4_1 tensors, fp32 activations", "float32", "gguf"),
    "gguf-exact": Variant("gguf-exact", "GGUF Q4_1 tensors, exact fp32 products", "float32", "gguf", False),
}
BYTES = (
    "bytes of weights read per token at batch 1: every weight of the decoder layers and of the LM head once (the "
    "embedding is a lookup), in the format the batch-1 kernel reads: 4 bytes a weight in fp32, 2 in bf16; int8 1 "
    "byte plus a bf16 scale per output channel; int4 half a byte plus a bf16 scale and minimum per group of 32; a "
    "GGUF's tensors (rosellm's gguf rows, llama.cpp's Q4_1 row) their size in the file; norms in fp32 (bf16 in "
    "bf16). rosellm's quantized layers run their packed kernels only with bf16 activations: with fp32 compute they "
    "multiply a dense fp32 copy of their weights, and read 4 bytes a weight; from chapter 18 they read their codes "
    "with fp32 compute too (8-bit activations, integer dot products)."
)


def chosen(text: str, point) -> list[Variant]:
    """The variants `--variants` names ("all": every one the checkpoint can run; fp32 alone before chapter 13,
    gguf-exact from chapter 18)."""
    names = [name for name in text.split(",") if name]
    if unknown := set(names) - {"all", *VARIANTS}:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from all, {', '.join(VARIANTS)}")
    can = list(VARIANTS) if "quantization" in point.capabilities else ["fp32"]
    can = [name for name in can if name != "gguf-exact" or "integer_dot" in point.capabilities]
    if names == ["all"]:
        return [VARIANTS[name] for name in can]
    if cannot := [name for name in names if name not in can]:
        raise SystemExit(f"{point.module} runs only {', '.join(can)}, not {', '.join(cannot)}")
    return [VARIANTS[name] for name in names]


def matrices(config) -> list[tuple[int, int, int]]:
    """(copies, out_features, in_features) of every matrix a token goes through: a decoder layer's
    projections (once per layer) and the LM head."""
    c, h = config, config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q, h), (kv, h), (kv, h), (h, q), (c.intermediate_size, h), (c.intermediate_size, h)]
    layer.append((h, c.intermediate_size))
    return [(c.num_hidden_layers, out, inp) for out, inp in layer] + [(1, c.vocab_size, h)]


def norm_weights(config) -> int:
    return (2 * config.num_hidden_layers + 1) * config.hidden_size


def gguf_bytes(path: Path) -> int:
    """Bytes in the file of the tensors a token reads: the layers, the final norm and the LM head ("output", or
    the token embedding when the head is tied to it)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return sum(n for name, n in tensors.items() if name.startswith("blk.")) + tensors["output_norm.weight"] + head


def bytes_per_token(form: str, config, model: Path | None = None) -> int:
    """Bytes of weights a batch-1 token reads in weight format `form`: a variant's name, "float32" or "bfloat16"
    for dense weights, "gguf" for the tensors of the GGUF file `model` as they are. Norms count in fp32 (in bf16
    for "bf16")."""
    weights = sum(n * out * inp for n, out, inp in matrices(config))
    channels = sum(n * out for n, out, _ in matrices(config))
    if form in ("fp32", "float32"):
        return 4 * (weights + norm_weights(config))
    if form in ("bf16", "bfloat16"):
        return 2 * (weights + norm_weights(config))
    if form == "int8":
        return weights + 2 * channels + 4 * norm_weights(config)
    if form == "int4":
        return weights // 2 + 4 * (weights // 32) + 4 * norm_weights(config)
    if form.startswith("gguf"):
        return gguf_bytes(model)
    raise ValueError(f"unknown weight format {form!r}")


def read_format(form: str, compute_dtype: str, integer_dot: bool = False) -> str:
    """The format rosellm's batch-1 kernels read for weights stored in `form`: a quantized layer with fp32
    activations multiplies its dense fp32 copy, unless it runs integer dot products on its codes (`integer_dot`,
    chapter 18's 8-bit activations)."""
    quantized = form in ("int8", "int4") or form.startswith("gguf")
    return "float32" if quantized and compute_dtype == "float32" and not integer_dot else form
