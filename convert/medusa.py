"""FasterDecoding/Medusa head checkpoints -> specjax Medusa heads.

The public format is a directory with `config.json` (`medusa_num_heads`, `medusa_num_layers`)
and `medusa_lm_head.pt` (or `.safetensors`): a ModuleList of Sequential(ResBlock x L, Linear),
so tensors are named `{head}.{block}.linear.weight|bias` and `{head}.{L}.weight`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from specjax.checkpoint import CheckpointError, read_json, read_safetensors, read_torch_bin
from specjax.heads import save_heads

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_medusa_dir(path: Path) -> bool:
    return any((Path(path) / f).exists() for f in WEIGHT_FILES)


def read_medusa(path: Path) -> tuple[dict, dict]:
    """(meta, flax variables) from a FasterDecoding Medusa directory."""
    path = Path(path)
    cfg = read_json(path / "config.json") if (path / "config.json").exists() else {}
    weights = next((path / f for f in WEIGHT_FILES if (path / f).exists()), None)
    if weights is None:
        raise CheckpointError(f"no Medusa weights ({' or '.join(WEIGHT_FILES)}) in {path}")
    sd = read_safetensors(weights) if weights.suffix == ".safetensors" else read_torch_bin(weights)
    heads = sorted({int(k.split(".")[0]) for k in sd})
    num_heads = int(cfg.get("medusa_num_heads", len(heads)))
    num_layers = int(cfg.get("medusa_num_layers", 1))
    if heads != list(range(num_heads)):
        raise CheckpointError(f"{weights} holds heads {heads}, config says {num_heads}")
    params = {}
    hidden = vocab = None
    for h in range(num_heads):
        head = {}
        for j in range(num_layers):
            w, b = sd.get(f"{h}.{j}.linear.weight"), sd.get(f"{h}.{j}.linear.bias")
            if w is None or b is None:
                raise CheckpointError(f"{weights} lacks tensor '{h}.{j}.linear.weight' or its bias")
            head[f"ResBlock_{j}"] = {"Dense_0": {"kernel": np.ascontiguousarray(w.T), "bias": b}}
            hidden = w.shape[1]
        out = sd.get(f"{h}.{num_layers}.weight")
        if out is None:
            raise CheckpointError(f"{weights} lacks tensor '{h}.{num_layers}.weight'")
        head["Dense_0"] = {"kernel": np.ascontiguousarray(out.T)}
        vocab, hidden = out.shape
        params[f"head_{h}"] = head
    unknown = [k for k in sd if not re.fullmatch(r"\d+\.(\d+\.linear\.(weight|bias)|\d+\.weight)", k)]
    if unknown:
        raise CheckpointError(f"unexpected tensor '{unknown[0]}' in {weights}")
    meta = {
        "num_heads": num_heads,
        "num_layers": num_layers,
        "hidden_size": int(hidden),
        "vocab_size": int(vocab),
        "own_lm_head": True,
        "base_model": cfg.get("base_model_name_or_path"),
    }
    return meta, {"params": params}


def convert_medusa(src, out) -> Path:
    meta, variables = read_medusa(Path(src))
    return save_heads(out, "medusa", variables, meta)
