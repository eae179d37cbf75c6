"""The model's shape, read from a Hugging Face `LlamaConfig`-style `config.json`."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        # transformers >= 5 nests rope_theta and the scaling in `rope_parameters`; older files keep
        # `rope_theta` and `rope_scaling` at the top level. Accept both.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = d.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        num_heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            attention_bias=d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
