"""Reading and writing model weights: Hugging Face directories and specjax checkpoints.

A specjax checkpoint is a directory with `specjax.json` (format marker), the model's Hugging Face
`config.json`, `model.safetensors` in specjax's layout (linear weights [out, in], flat names such
as `layers.3.wq`) and the tokenizer files, so it loads without conversion and converts back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from specjax.config import ConfigError, ModelConfig

FORMAT_FILE = "specjax.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)

# specjax layer key -> HF names under model.layers.{i}. (both store linear weights [out, in]);
# fused keys concatenate their parts in this order along the output axis.
_LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight",),
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "bqkv": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "wo": ("self_attn.o_proj.weight",),
    "mlp_norm": ("post_attention_layernorm.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}
# Specjax checkpoints up to version 1 stored linear weights [in, out]; loading transposes them.
FORMAT_VERSION = 2
LINEAR_KEYS = ("wqkv", "wo", "w_gate_up", "w_down", "wq", "wk", "wv", "w_gate", "w_up")


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt JSON in {path}: {e}") from None


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for bad headers and sizes
        if "bfloat16" in str(e) or "bf16" in str(e).lower():
            return _read_safetensors_torch(path)
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None
    return tensors


def _read_safetensors_torch(path: Path) -> dict[str, np.ndarray]:
    """bfloat16 safetensors, read through torch and widened to float32."""
    try:
        from safetensors.torch import load_file
        import torch
    except ImportError:
        raise CheckpointError(f"{path} holds bfloat16 tensors; install torch to read it") from None
    try:
        return {k: v.to(torch.float32).numpy() for k, v in load_file(str(path)).items()}
    except Exception as e:
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None


def _read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} is a PyTorch .bin checkpoint; install torch to read it") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"corrupt or truncated PyTorch checkpoint {path}: {e}") from None
    return {k: v.to(torch.float32).numpy() if v.is_floating_point() else v.numpy()
            for k, v in state.items()}


def read_hf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a Hugging Face model directory (safetensors, sharded or not, or .bin)."""
    model_dir = Path(model_dir)
    for index_name, reader in (("model.safetensors.index.json", _read_safetensors),
                               ("pytorch_model.bin.index.json", _read_torch_bin)):
        index = model_dir / index_name
        if index.exists():
            files = sorted(set(read_json(index)["weight_map"].values()))
            tensors = {}
            for f in files:
                if not (model_dir / f).exists():
                    raise CheckpointError(f"missing weight shard {model_dir / f}")
                tensors.update(reader(model_dir / f))
            return tensors
    if (model_dir / "model.safetensors").exists():
        return _read_safetensors(model_dir / "model.safetensors")
    if (model_dir / "pytorch_model.bin").exists():
        return _read_torch_bin(model_dir / "pytorch_model.bin")
    raise CheckpointError(f"no weights (model.safetensors or pytorch_model.bin) in {model_dir}")


def tensor_access(tensors: dict[str, np.ndarray], source: str = "checkpoint", dtype=np.float32):
    """(get, expect): fetch a tensor by name, and check its shape, with errors that name it."""

    def get(name):
        if name not in tensors:
            raise CheckpointError(f"{source} lacks tensor '{name}'")
        return tensors[name]

    def expect(name, arr, shape):
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor '{name}' has shape {tuple(arr.shape)}, config says {shape}")
        return np.ascontiguousarray(arr, dtype=dtype)

    return get, expect


def hf_to_params(tensors: dict[str, np.ndarray], config: ModelConfig, dtype=np.float32) -> dict:
    """specjax parameter pytree (numpy) from Hugging Face tensor names."""
    get, expect = tensor_access(tensors, dtype=dtype)

    d, v = config.hidden_size, config.vocab_size
    layers = [hf_layer_params(get, expect, f"model.layers.{i}.", config)
              for i in range(config.num_layers)]
    params = {
        "embed": expect("model.embed_tokens.weight", get("model.embed_tokens.weight"), (v, d)),
        "layers": layers,
        "norm": expect("model.norm.weight", get("model.norm.weight"), (d,)),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = expect("lm_head.weight", get("lm_head.weight"), (v, d))
    return params


def hf_layer_params(get, expect, prefix: str, config: ModelConfig, input_norm: bool = True) -> dict:
    """One decoder layer's specjax parameters from HF tensor names under `prefix`.

    get(name) returns a tensor (or raises naming it); expect(name, array, shape) checks shapes.
    """
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d),
              "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d),
              "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
              "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (d, q),
              "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (f, d),
              "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    layer = {}
    for key, suffixes in _LAYER_KEYS.items():
        if (key == "bqkv" and not config.attention_bias) or (key == "attn_norm" and not input_norm):
            continue
        parts = []
        for suffix in suffixes:
            name = prefix + suffix
            arr = get(name)
            parts.append(expect(name, arr, shapes[suffix]))
        layer[key] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return layer


def params_to_hf(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Hugging Face tensor names and [out, in] layout from a specjax parameter pytree."""
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["norm"])}
    if "lm_head" in params:
        out["lm_head.weight"] = np.asarray(params["lm_head"])
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    widths = {"wqkv": [q, kv, kv], "bqkv": [q, kv, kv],
              "w_gate_up": [config.intermediate_size] * 2}
    for i, layer in enumerate(params["layers"]):
        for key, arr in layer.items():
            arr = np.asarray(arr)
            parts = np.split(arr, np.cumsum(widths[key])[:-1], axis=0) if key in widths else [arr]
            for suffix, part in zip(_LAYER_KEYS[key], parts):
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(part)
    return out


def flatten_params(params: dict) -> dict[str, np.ndarray]:
    flat = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    for i, layer in enumerate(params["layers"]):
        for k, v in layer.items():
            flat[f"layers.{i}.{k}"] = np.asarray(v)
    return flat


def unflatten_params(flat: dict[str, np.ndarray], config: ModelConfig,
                     version: int = FORMAT_VERSION) -> dict:
    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    for name, arr in flat.items():
        if name.startswith("layers."):
            _, i, key = name.split(".", 2)
            if int(i) >= config.num_layers:
                raise CheckpointError(f"tensor '{name}' beyond num_hidden_layers={config.num_layers}")
            if version < 2 and key in LINEAR_KEYS:
                arr = np.ascontiguousarray(arr.T)
            params["layers"][int(i)][key] = arr
        else:
            params[name] = arr
    for key in ("embed", "norm") + (() if config.tie_word_embeddings else ("lm_head",)):
        if key not in params:
            raise CheckpointError(f"specjax checkpoint lacks tensor '{key}'")
    needed = {"attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"}
    for i, layer in enumerate(params["layers"]):
        missing = needed - set(layer)
        if missing:
            raise CheckpointError(f"specjax checkpoint lacks layers.{i}.{sorted(missing)[0]}")
    return params


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def _atomic_dir(out_dir: Path):
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _finish_dir(tmp: Path, out_dir: Path):
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def save_specjax(out_dir: Path, params: dict, config: ModelConfig, hf_config: dict | None = None,
                 tokenizer_dir: Path | None = None) -> Path:
    """Write a specjax checkpoint (atomically: a crash leaves no half checkpoint)."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    tmp = _atomic_dir(out_dir)
    save_file(flatten_params(params), str(tmp / WEIGHTS_FILE))
    (tmp / "config.json").write_text(json.dumps(hf_config or config.to_hf(), indent=2))
    (tmp / FORMAT_FILE).write_text(json.dumps({"format": "specjax", "version": FORMAT_VERSION,
                                                  "kind": "model"}))
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), tmp)
    _finish_dir(tmp, out_dir)
    return out_dir


def save_hf(out_dir: Path, params: dict, config: ModelConfig, hf_config: dict | None = None,
            tokenizer_dir: Path | None = None) -> Path:
    """Write a Hugging Face model directory (config.json + model.safetensors + tokenizer)."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    tmp = _atomic_dir(out_dir)
    save_file(params_to_hf(params, config), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config or config.to_hf(), indent=2))
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), tmp)
    _finish_dir(tmp, out_dir)
    return out_dir


def is_specjax_checkpoint(path: Path) -> bool:
    return (Path(path) / FORMAT_FILE).exists()


def load_checkpoint(path: Path, dtype=np.float32) -> tuple[dict, ModelConfig, dict]:
    """(params as numpy, ModelConfig, HF config dict) from a specjax or Hugging Face directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint directory: {path}")
    if not (path / "config.json").exists():
        raise CheckpointError(f"not a checkpoint: {path} has no config.json")
    hf_config = read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf(hf_config)
    except ConfigError:
        raise
    if is_specjax_checkpoint(path):
        weights = path / WEIGHTS_FILE
        if not weights.exists():
            raise CheckpointError(f"missing weights file {weights}")
        flat = _read_safetensors(weights)
        version = int(read_json(path / FORMAT_FILE).get("version", 1))
        params = unflatten_params({k: v.astype(dtype) if v.dtype.kind == "f" else v
                                   for k, v in flat.items()}, config, version)
    else:
        params = hf_to_params(read_hf_tensors(path), config, dtype)
    return params, config, hf_config
