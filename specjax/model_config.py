"""Model configuration of the Llama family, read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A checkpoint's config that specjax cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a Llama-family decoder (hashable: a jit static argument)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 RoPE scaling as a sorted tuple of (key, value) pairs, or None.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Qwen3: RMSNorm over each head's query and key vectors (weights [head_dim]) before RoPE,
    # and a bias on the output projection when attention_bias is set.
    qk_norm: bool = False
    o_proj_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict; unsupported architectures are named."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(cfg.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            name = arch or cfg.get("model_type") or "<none>"
            raise ConfigError(f"unsupported architecture '{name}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope_scaling = cfg.get("rope_scaling")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 spelling
            rope_theta = cfg.get("rope_theta")
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind == "default":
                    rope_scaling = None
                elif kind != "llama3":
                    raise ConfigError(f"unsupported rope_scaling type '{kind}' (supported: llama3)")
                else:
                    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                    rope_scaling = tuple(sorted((k, float(rope_scaling[k])) for k in keep))
            act = cfg.get("hidden_act", "silu")
            if act != "silu":
                raise ConfigError(f"unsupported hidden_act '{act}' (supported: silu)")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
            model_type = SUPPORTED_ARCHITECTURES[arch]
            window = cfg.get("sliding_window") if model_type == "mistral" else None
            if model_type == "qwen2" and cfg.get("use_sliding_window"):
                window = cfg.get("sliding_window")
            if model_type == "qwen3":
                window = _qwen3_window(cfg)
            bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bias,
                qk_norm=model_type == "qwen3",
                o_proj_bias=bias and model_type == "qwen3",
                sliding_window=None if window is None else int(window),
                architecture=arch,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the field {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config dict of this model."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else {"rope_type": "llama3", **dict(self.rope_scaling)},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type == "qwen3":  # a window here covers every layer (`_qwen3_window`)
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = 0
        return out


def _qwen3_window(cfg: dict[str, Any]) -> int | None:
    """Qwen3's sliding window, applied to every layer or to none. With `use_sliding_window`,
    transformers slides the layers `layer_types` names "sliding_attention" (by default those from
    `max_window_layers`, 28, on); a mix of windowed and full layers is refused."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window is None:
        return None
    first = int(cfg.get("max_window_layers", 28))
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True, False}:
        raise ConfigError("a sliding window on some layers only is not supported (layer_types mixes them)")
    return window if sliding == {True} else None
