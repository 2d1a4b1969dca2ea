"""Draft-head checkpoints: a directory with `specjax.json` (kind and shapes) and `heads.safetensors`.

Flax variables are stored flat, with '/'-joined names (e.g. `head_0/ResBlock_0/Dense_0/kernel`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from specjax.checkpoint import (
    FORMAT_FILE,
    FORMAT_VERSION,
    LINEAR_KEYS,
    CheckpointError,
    atomic_dir,
    finish_dir,
    read_json,
    read_safetensors,
    release_read,
)
from specjax.model_config import ModelConfig

HEADS_FILE = "heads.safetensors"


def save_heads(out_dir, kind: str, variables: dict, meta: dict) -> Path:
    """Write a head checkpoint of `kind` (e.g. "medusa") with its metadata."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    tmp = atomic_dir(out_dir)
    flat = {"/".join(k): np.asarray(v) for k, v in flatten_dict(variables).items()}
    save_file(flat, str(tmp / HEADS_FILE))
    (tmp / FORMAT_FILE).write_text(
        json.dumps({"format": "specjax", "version": FORMAT_VERSION, "kind": kind, **meta}, indent=2)
    )
    finish_dir(tmp, out_dir)
    return out_dir


def load_heads(path, kind: str | None = None) -> tuple[dict, dict]:
    """(meta, variables) of a head checkpoint; `kind` checks what it holds."""
    path = Path(path)
    if not (path / FORMAT_FILE).exists():
        raise CheckpointError(f"not a specjax head checkpoint: {path} has no {FORMAT_FILE}")
    meta = read_json(path / FORMAT_FILE)
    if meta.get("kind") in (None, "model"):
        raise CheckpointError(f"{path} is a model checkpoint, not draft heads")
    if kind is not None and meta["kind"] != kind:
        raise CheckpointError(f"{path} holds {meta['kind']} heads, not {kind} heads")
    if not (path / HEADS_FILE).exists():
        raise CheckpointError(f"missing weights file {path / HEADS_FILE}")
    tensors = read_safetensors(path / HEADS_FILE)
    transpose = int(meta.get("version", 1)) < 2  # draft layers stored [in, out] (checkpoint.py)
    flat = {}
    for name in tensors:  # one tensor on the host at a time
        arr = tensors[name]
        if transpose and name.startswith("layers/") and name.split("/")[-1] in LINEAR_KEYS:
            arr = arr.T
        flat[tuple(name.split("/"))] = jnp.asarray(arr).block_until_ready()
        release_read(tensors)  # copied to the device: its file pages can go
    return meta, unflatten_dict(flat)


def check_compatible(meta: dict, config: ModelConfig, path) -> None:
    """Heads trained for another hidden size or vocabulary are refused by name."""
    for key, want in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size)):
        if key in meta and int(meta[key]) != want:
            raise CheckpointError(f"head checkpoint {path} has {key} {meta[key]}, the model has {want}")
