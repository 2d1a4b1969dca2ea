"""SafeAILab EAGLE-3 draft heads -> specjax "eagle3" heads.

The public format (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) is a directory with a Llama-style
`config.json` (the target's shapes, `num_hidden_layers` 1, `draft_vocab_size`, architecture
often `LlamaForCausalLMEagle3`) and `pytorch_model.bin` or `model.safetensors` holding
`fc.weight` [D, 3D] (no bias), `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
.weight`, `midlayer.self_attn.{q,k,v}_proj.weight` [*, 2D], `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` [draft_vocab, D],
`d2t` (int [draft_vocab], target = draft + d2t[draft]) and `t2d` (bool [vocab]).
An `embed_tokens.weight` is kept as the head's own embedding: SafeAILab loads the base model's
embedding first and the checkpoint's tensors over it. Heads whose `target_hidden_size` differs
from `hidden_size` must carry one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specjax.checkpoint import CheckpointError, read_json, read_safetensors, read_torch_bin, tensor_access
from specjax.convert.eagle import WEIGHT_FILES, head_tensor_names
from specjax.model_config import ConfigError, ModelConfig
from specjax.proposers.eagle3_net import save_eagle3_heads, t2d_mask

MARKERS = ("midlayer.", "d2t", "t2d")


def is_eagle3_dir(path: Path) -> bool:
    """A directory holding SafeAILab EAGLE-3 heads (a `midlayer` and/or a d2t vocabulary map)."""
    names = head_tensor_names(path) or []
    return "fc.weight" in names and any(n.startswith(MARKERS) for n in names)


def _as_int(name: str, arr: np.ndarray, shape) -> np.ndarray:
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor '{name}' has shape {tuple(arr.shape)}, config says {shape}")
    if not np.all(np.isfinite(arr)) or not np.array_equal(arr, np.rint(arr)):
        raise CheckpointError(f"tensor '{name}' holds non-integer values")
    return np.asarray(arr).astype(np.int64)


def read_eagle3(path: Path) -> tuple[ModelConfig, dict, dict]:
    """(draft config, params, meta) from a SafeAILab EAGLE-3 directory."""
    path = Path(path)
    raw = dict(read_json(path / "config.json"))
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(
            f"{path}: EAGLE-3 heads with {raw['num_hidden_layers']} layers are not supported (SafeAILab's have one)"
        )
    if raw.get("norm_before_residual"):
        raise CheckpointError(f"{path}: norm_before_residual EAGLE-3 heads are not supported")
    weights = next((path / f for f in WEIGHT_FILES if (path / f).exists()), None)
    if weights is None:
        raise CheckpointError(f"no EAGLE-3 weights ({' or '.join(WEIGHT_FILES)}) in {path}")
    sd = read_safetensors(weights) if weights.suffix == ".safetensors" else read_torch_bin(weights)

    raw["architectures"] = ["LlamaForCausalLM"]  # the draft layer is a Llama layer
    raw["attention_bias"] = "midlayer.self_attn.q_proj.bias" in sd
    raw["num_hidden_layers"] = 1
    raw.pop("sliding_window", None)
    try:
        config = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    get, expect = tensor_access(sd, str(weights))
    d, v = config.hidden_size, config.vocab_size
    dt = int(raw.get("target_hidden_size") or d)
    vd = int(raw.get("draft_vocab_size") or v)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    f = config.intermediate_size

    def lin(name, out_dim, in_dim):  # [out, in] in both
        return expect(name, get(name), (out_dim, in_dim))

    def vec(name, n):
        return expect(name, get(name), (n,))

    p = "midlayer."
    layer = {
        "attn_norm": vec(p + "input_layernorm.weight", d),
        "hidden_norm": vec(p + "hidden_norm.weight", d),
        "wqkv": np.concatenate(
            [
                lin(p + "self_attn.q_proj.weight", q, 2 * d),
                lin(p + "self_attn.k_proj.weight", kv, 2 * d),
                lin(p + "self_attn.v_proj.weight", kv, 2 * d),
            ],
            axis=0,
        ),
        "wo": lin(p + "self_attn.o_proj.weight", d, q),
        "mlp_norm": vec(p + "post_attention_layernorm.weight", d),
        "w_gate_up": np.concatenate(
            [lin(p + "mlp.gate_proj.weight", f, d), lin(p + "mlp.up_proj.weight", f, d)], axis=0
        ),
        "w_down": lin(p + "mlp.down_proj.weight", d, f),
    }
    if config.attention_bias:
        layer["bqkv"] = np.concatenate(
            [
                vec(p + "self_attn.q_proj.bias", q),
                vec(p + "self_attn.k_proj.bias", kv),
                vec(p + "self_attn.v_proj.bias", kv),
            ]
        )
    fc = {"kernel": lin("fc.weight", d, 3 * dt).T.copy()}  # flax Dense kernel: [in, out]
    if "fc.bias" in sd:
        fc["bias"] = vec("fc.bias", d)
    params = {
        "fc": fc,
        "layers": [layer],
        "norm": vec("norm.weight", d),
        "lm_head": expect("lm_head.weight", get("lm_head.weight"), (vd, d)),
    }
    if "embed_tokens.weight" in sd:
        params["embed"] = expect("embed_tokens.weight", sd["embed_tokens.weight"], (v, d))
    elif dt != d:
        raise CheckpointError(
            f"{weights} lacks 'embed_tokens.weight', needed when "
            f"target_hidden_size ({dt}) differs from hidden_size ({d})"
        )

    if "d2t" in sd:
        d2t = _as_int("d2t", sd["d2t"], (vd,))
    elif vd == v:
        d2t = np.zeros(vd, np.int64)
    else:
        raise CheckpointError(f"{weights} lacks tensor 'd2t' (draft_vocab_size {vd} < {v})")
    target = np.arange(vd) + d2t
    if np.any(target < 0) or np.any(target >= v) or len(np.unique(target)) != vd:
        raise CheckpointError(f"tensor 'd2t' maps draft ids outside [0, {v}) or onto one id twice")
    if "t2d" in sd:
        t2d = _as_int("t2d", sd["t2d"], (v,)).astype(bool)
        if not np.array_equal(t2d, t2d_mask(d2t, v)):
            raise CheckpointError("tensors 't2d' and 'd2t' disagree on the draft vocabulary")
    params["d2t"] = d2t.astype(np.int32)

    layers = None
    key = "eagle_aux_hidden_state_layer_ids"  # vLLM / SGLang: id j = input of target layer j
    ids = raw.get(key) or (raw.get("eagle_config") or {}).get(key)
    if ids:  # inputs of those target layers = outputs of the layers before them
        if len(ids) != 3 or min(ids) < 1:
            raise CheckpointError(f"{path}: unsupported eagle_aux_hidden_state_layer_ids {ids}")
        layers = [int(i) - 1 for i in ids]
    meta = {"hidden_size": dt, "vocab_size": v, "feature_layers": layers}
    return config, params, meta


def convert_eagle3(src, out) -> Path:
    config, params, meta = read_eagle3(Path(src))
    return save_eagle3_heads(out, config, params, meta)
