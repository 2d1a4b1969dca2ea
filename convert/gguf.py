"""Convert a Llama- or Qwen3-architecture GGUF file into a Hugging Face-format model directory.

The output is a plain float32 `LlamaForCausalLM` or `Qwen3ForCausalLM` checkpoint (config.json,
model.safetensors, tokenizer files, generation_config.json) that both transformers and specjax's
own loader read without knowing anything about GGUF. Quantized tensors (Q4_1, Q8_0, ...) are
dequantized with the `gguf` package, so the result holds exactly the values llama.cpp would
compute with.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's `general.architecture` -> (HF architecture, model_type).
_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
SUPPORTED_ARCHITECTURES = tuple(_HF_ARCHITECTURES)

# GGUF tensor name (after the `blk.{i}.` prefix for per-layer ones) -> HF name.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per-architecture layer tensors beyond those (Qwen3's per-head q/k norms).
_EXTRA_LAYER_TENSORS = {
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
}
# Architectures whose q/k rows llama.cpp permutes (its LlamaModel; Qwen3's are stored as in HF).
_PERMUTED_QK = ("llama",)
# Tensors llama.cpp writes that have no HF counterpart (precomputed Llama-3 rope frequencies;
# HF recomputes them from rope_scaling).
_IGNORED_TENSORS = {"rope_freqs.weight"}


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert the Llama or Qwen3 GGUF at `gguf_path` into a float32 HF model directory `out_dir`.

    The directory is built in a temporary sibling and renamed into place at the end, so an
    interrupted run never leaves a directory that looks complete. Raises `ValueError` with a
    one-line message for a missing, corrupt or unsupported file, or a non-empty `out_dir`.
    Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    _check_out_dir(out_dir)
    reader = _open_reader(gguf_path)
    arch = _architecture(reader, gguf_path)
    config = _hf_config(reader, arch, gguf_path)
    tensors = _hf_tensors(reader, arch, config, gguf_path)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the final model dir should be readable
        _save_weights(tensors, tmp / "model.safetensors")
        del tensors
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        if _field(reader, "tokenizer.ggml.model") is not None:
            _write_tokenizer(reader, gguf_path, tmp, config["max_position_embeddings"])
        _check_out_dir(out_dir)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# --------------------------------------------------------------------------- reading


def _open_reader(path: Path):
    """Open `path` with `gguf.GGUFReader`, turning every failure into a one-line ValueError."""
    import gguf

    if not path.exists():
        raise ValueError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"GGUF path is not a file: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct/index errors, mmap errors...
        raise ValueError(f"not a valid GGUF file (corrupt or truncated?): {path}: {_one_line(e)}") from e
    for t in reader.tensors:  # a truncated file can parse but leave short tensor views
        if t.data.nbytes != t.n_bytes:
            raise ValueError(f"truncated GGUF file: tensor {t.name!r} is incomplete in {path}")
    return reader


def _one_line(e: BaseException) -> str:
    """First line of an exception's message, prefixed by its type, for one-line errors."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def _field(reader, key: str, default: Any = None) -> Any:
    """Value of GGUF metadata `key` as a Python scalar, str or list (`default` if absent).

    Parses `ReaderField.parts` directly rather than `contents()`, which old gguf releases lack.
    """
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default
    T = gguf.GGUFValueType

    def scalar(part, vtype):
        return bytes(part).decode("utf-8") if vtype == T.STRING else part.tolist()[0]

    if field.types[0] == T.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _architecture(reader, path: Path) -> str:
    """The file's `general.architecture`, which must be one we can convert."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)}): {path}"
        )
    return arch


def _required(reader, key: str, path: Path) -> Any:
    """Metadata value that must be present; a missing one means a broken or foreign file."""
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} missing in {path}")
    return value


# --------------------------------------------------------------------------- config


def _hf_config(reader, arch: str, path: Path) -> dict:
    """HF `LlamaConfig` / `Qwen3Config` fields from the GGUF metadata (vocab/tie are settled from
    the tensors)."""
    hidden = int(_required(reader, f"{arch}.embedding_length", path))
    n_heads = int(_required(reader, f"{arch}.attention.head_count", path))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads))
    n_rot = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if n_rot != head_dim:
        raise ValueError(f"partial rotary embedding (rope dim {n_rot} != head dim {head_dim}) not supported: {path}")
    rope_theta = _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(reader, arch)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": [_HF_ARCHITECTURES[arch][0]],
        "model_type": _HF_ARCHITECTURES[arch][1],
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count", path)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    # transformers >= 5 reads rope settings from `rope_parameters`; older ones from the two above.
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
        config["rope_parameters"] = {**rope_scaling, "rope_theta": rope_theta}
    return config


def _f32(value) -> float:
    """A GGUF float32 as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(reader, arch: str) -> dict | None:
    """HF `rope_scaling` from llama.cpp's `{arch}.rope.scaling.*` keys, or None if unscaled."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": _f32(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _generation_config(config: dict) -> dict:
    """Minimal generation_config.json carrying the special token ids."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config[k] is not None}


# --------------------------------------------------------------------------- tensors


def _layer_tensors(arch: str) -> dict[str, str]:
    """GGUF layer tensor name (after `blk.{i}.`) -> HF name under model.layers.{i}., for `arch`."""
    return {**_LAYER_TENSORS, **_EXTRA_LAYER_TENSORS.get(arch, {})}


def _hf_tensors(reader, arch: str, config: dict, path: Path) -> dict[str, np.ndarray]:
    """All GGUF tensors dequantized to float32, in HF layout and under HF names.

    Also fixes `config["vocab_size"]` from the embedding's row count, the authoritative value.
    """
    n_layers = config["num_hidden_layers"]
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS:
            continue
        hf_name = _hf_name(t.name, arch, n_layers, path)
        w = _dequantize(t, path)
        if arch in _PERMUTED_QK and hf_name.endswith("q_proj.weight"):
            w = _reverse_permute(w, config["num_attention_heads"])
        elif arch in _PERMUTED_QK and hf_name.endswith("k_proj.weight"):
            w = _reverse_permute(w, config["num_key_value_heads"])
        out[hf_name] = w
    _check_complete(out, arch, n_layers, path)
    config["vocab_size"] = int(out["model.embed_tokens.weight"].shape[0])
    return out


def _hf_name(name: str, arch: str, n_layers: int, path: Path) -> str:
    """HF parameter name for GGUF tensor `name`; unknown tensors are an error, not dropped."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    layer_tensors = _layer_tensors(arch)
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        layer = int(parts[1])
        if layer < n_layers:
            return f"model.layers.{layer}.{layer_tensors[parts[2]]}"
    raise ValueError(f"unexpected tensor {name!r} for a {arch} GGUF: {path}")


def _check_complete(tensors: dict, arch: str, n_layers: int, path: Path) -> None:
    """Every tensor the HF model of `arch` needs must be present."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    need += [f"model.layers.{i}.{v}" for i in range(n_layers) for v in _layer_tensors(arch).values()]
    missing = [n for n in need if n not in tensors]
    if missing:
        raise ValueError(f"GGUF is missing {len(missing)} tensor(s), e.g. {missing[0]!r}: {path}")


def _dequantize(tensor, path: Path) -> np.ndarray:
    """Tensor values as a C-contiguous float32 array in HF (row-major, reversed GGUF dims) shape."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        w = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}): {path}") from e
    return np.ascontiguousarray(np.asarray(w, dtype=np.float32).reshape(shape))


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary halves -> interleaved pairs).

    llama.cpp's converter does `w.reshape(n_head, 2, d, ...).swapaxes(1, 2)` with
    d = rows // n_head // 2; this is its exact inverse, as in transformers' GGUF loader.
    """
    d = w.shape[0] // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# --------------------------------------------------------------------------- writing


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace a non-empty directory (an empty one may be replaced)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"output directory already exists and is not empty: {out_dir}")


def _save_weights(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write float32 tensors as safetensors with the metadata transformers expects."""
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it 0600


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(reader, gguf_path: Path, out: Path, max_len: int) -> None:
    """Write tokenizer.json / tokenizer_config.json / special_tokens_map.json.

    The tokenizer is rebuilt from the metadata by `specjax.convert.gguf_tokenizer` (no torch); the chat
    template, BOS behaviour and special tokens are pinned in tokenizer_config.json so any
    transformers version finds them there.
    """
    from specjax.convert.gguf_tokenizer import gguf_tokenizer, special_token_strings

    meta = {k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.")}
    try:
        tok = gguf_tokenizer(meta)
    except Exception as e:
        raise ValueError(f"cannot build the tokenizer from GGUF metadata: {gguf_path}: {_one_line(e)}") from e
    tok.save_pretrained(str(out))

    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    for k in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(k, None)
    cfg["model_max_length"] = max_len
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers version knows
    if meta.get("tokenizer.chat_template") is not None:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    for key in ("add_bos_token", "add_eos_token"):
        cfg[key] = bool(getattr(tok, key))
    special = special_token_strings(meta)
    cfg.update(special)
    _write_json(cfg_path, cfg)
    _write_json(out / "special_tokens_map.json", special)
