"""SafeAILab EAGLE-1/2 draft heads -> specjax EAGLE heads.

The public format is a directory with a Llama-style `config.json` (num_hidden_layers of the draft,
usually 1) and `pytorch_model.bin` or `model.safetensors` holding `fc.weight` [D, 2D],
`fc.bias`, and `layers.{i}.*` decoder-layer tensors (layer 0 without `input_layernorm`).
An `embed_tokens.weight` copy of the base embedding, when present, is not needed: specjax drafts
with the target's own embedding.
"""

from __future__ import annotations

from pathlib import Path

from specjax.checkpoint import (
    CheckpointError,
    hf_layer_params,
    read_json,
    read_safetensors,
    read_torch_bin,
    tensor_access,
)
from specjax.heads import save_heads
from specjax.model_config import ModelConfig

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _tensor_names(path: Path) -> list[str]:
    """Names in a weights file without reading the tensors."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            return list(f.keys())
    import torch

    return list(torch.load(str(path), map_location="cpu", weights_only=True, mmap=True).keys())


def head_tensor_names(path: Path) -> list[str] | None:
    """Tensor names of a head directory (config.json + weights file), else None."""
    path = Path(path)
    if not (path / "config.json").exists():
        return None
    weights = next((path / f for f in WEIGHT_FILES if (path / f).exists()), None)
    if weights is None:
        return None
    try:
        return _tensor_names(weights)
    except Exception:
        return None


def is_eagle_dir(path: Path) -> bool:
    """A directory holding SafeAILab EAGLE heads (an `fc` over [embedding; feature])."""
    names = head_tensor_names(path) or []
    # EAGLE-3 heads (convert/eagle3.py) also hold an fc: a `midlayer` or d2t/t2d marks them.
    return "fc.weight" in names and not any(k.startswith(("model.", "midlayer.")) or k in ("d2t", "t2d") for k in names)


def read_eagle(path: Path) -> tuple[dict, dict]:
    """(meta, params) from a SafeAILab EAGLE-1/2 directory."""
    path = Path(path)
    raw = read_json(path / "config.json")
    raw.setdefault("architectures", ["LlamaForCausalLM"])
    config = ModelConfig.from_hf(raw)
    weights = next((path / f for f in WEIGHT_FILES if (path / f).exists()), None)
    if weights is None:
        raise CheckpointError(f"no EAGLE weights ({' or '.join(WEIGHT_FILES)}) in {path}")
    sd = read_safetensors(weights) if weights.suffix == ".safetensors" else read_torch_bin(weights)

    get, expect = tensor_access(sd, str(weights))
    d = config.hidden_size
    fc = {"kernel": expect("fc.weight", get("fc.weight"), (d, 2 * d)).T.copy()}
    if "fc.bias" in sd:
        fc["bias"] = expect("fc.bias", sd["fc.bias"], (d,))
    layers = [
        hf_layer_params(get, expect, f"layers.{i}.", config, input_norm=f"layers.{i}.input_layernorm.weight" in sd)
        for i in range(config.num_layers)
    ]
    meta = {"hidden_size": d, "vocab_size": config.vocab_size, "config": config.to_hf()}
    flat_layers = {str(i): layer for i, layer in enumerate(layers)}
    return meta, {"fc": fc, "layers": flat_layers}


def convert_eagle(src, out) -> Path:
    meta, params = read_eagle(Path(src))
    return save_heads(out, "eagle", params, meta)
