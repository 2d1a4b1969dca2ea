"""DFlash drafters on disk: the public format (z-lab/dflash; e.g. z-lab/Qwen3-8B-DFlash-b16) read
into specjax's drafter config, parameters and head metadata, and either kind loaded for a target.

The public format is a directory with a Qwen3-style `config.json` (architectures
["DFlashDraftModel"], model_type qwen3, the drafter's hidden_size / num_hidden_layers / heads /
head_dim / intermediate_size / rms_norm_eps / rope, `block_size` and `num_target_layers`, and
`dflash_config`: {"mask_token_id", "target_layer_ids"}; the reference reads each of these from
`dflash_config` first, then from the top level) and `model.safetensors` holding, with no prefix
(an HF-style `model.` prefix is accepted too) and no embedding or LM head (the target's are used):
`fc.weight` [D, n * Dt], `hidden_norm.weight`, `norm.weight` and per layer i
`layers.{i}.input_layernorm.weight`, `layers.{i}.post_attention_layernorm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight` [head_dim],
`layers.{i}.mlp.{gate,up,down}_proj.weight`. `target_layer_ids` index target layer outputs (the
reference reads `hidden_states[id + 1]`), as specjax's feature layers do; without them the
reference's `build_target_layer_ids(num_target_layers, num_hidden_layers)` applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoint import CheckpointError, read_json, read_safetensors, tensor_access
from specjax.model_config import ConfigError, ModelConfig
from specjax.proposers.dflash_net import default_target_layers, load_dflash_heads

WEIGHTS = "model.safetensors"
# Variants of the format this reader does not read (DFlash-2's convolutions and selector).
UNSUPPORTED = ("candidate_selector.", "attention_conv.", "mlp_conv.", "encoder.")


def _value(raw: dict, name: str, default=None):
    """The reference's `_draft_value`: dflash_config's entry, else the top level's."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def read_dflash(path: Path) -> tuple[ModelConfig, dict, dict]:
    """(drafter config, net params as numpy, meta) of a public DFlash directory."""
    path = Path(path)
    raw = dict(read_json(path / "config.json"))
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"no DFlash weights ({WEIGHTS}) in {path}")
    sd = read_safetensors(path / WEIGHTS)
    names = list(sd.keys()) if hasattr(sd, "keys") else list(sd)
    bad = [n for n in names if n.removeprefix("model.").startswith(UNSUPPORTED)]
    if bad:
        raise CheckpointError(f"{path}: '{bad[0]}' belongs to a DFlash variant specjax does not read (DFlash-2)")
    prefix = "model." if "model.fc.weight" in names and "fc.weight" not in names else ""
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or raw.get("use_sliding_window"):
        raise CheckpointError(f"{path}: DFlash drafters with sliding-window layers are not supported")
    if raw.get("attention_bias"):
        raise CheckpointError(f"{path}: DFlash drafters with attention biases are not supported")
    scale = float(_value(raw, "input_embedding_scale", 1.0))
    if scale != 1.0:
        raise CheckpointError(f"{path}: input_embedding_scale {scale} is not supported (1.0 only)")
    mask = _value(raw, "mask_token_id")
    if mask is None:
        raise CheckpointError(f"{path / 'config.json'} names no mask_token_id (in dflash_config or at its top level)")
    hf = {k: v for k, v in raw.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    hf["architectures"] = ["Qwen3ForCausalLM"]  # the drafter's layers are Qwen3 layers
    hf["model_type"] = "qwen3"
    try:
        config = ModelConfig.from_hf(hf)
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    ids = _value(raw, "target_layer_ids")
    if ids is None:
        if "num_target_layers" not in raw:
            raise CheckpointError(f"{path / 'config.json'} names neither target_layer_ids nor num_target_layers")
        ids = default_target_layers(int(raw["num_target_layers"]), config.num_layers)
    ids = [int(i) for i in ids]
    block = int(_value(raw, "block_size", 16))

    get, expect = tensor_access(sd, str(path / WEIGHTS))
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    fc = get(prefix + "fc.weight")
    if fc.ndim != 2 or fc.shape[0] != d or fc.shape[1] % len(ids):
        raise CheckpointError(
            f"tensor 'fc.weight' has shape {tuple(fc.shape)}, expected ({d}, {len(ids)} x target hidden)"
        )
    target_hidden = fc.shape[1] // len(ids)

    def t(name, *shape):
        return expect(prefix + name, get(prefix + name), shape)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append(
            {
                "attn_norm": t(p + "input_layernorm.weight", d),
                "wq": t(p + "self_attn.q_proj.weight", q, d),
                "wkv": np.concatenate(
                    [t(p + "self_attn.k_proj.weight", kv, d), t(p + "self_attn.v_proj.weight", kv, d)], axis=0
                ),
                "q_norm": t(p + "self_attn.q_norm.weight", hd),
                "k_norm": t(p + "self_attn.k_norm.weight", hd),
                "wo": t(p + "self_attn.o_proj.weight", d, q),
                "mlp_norm": t(p + "post_attention_layernorm.weight", d),
                "w_gate_up": np.concatenate(
                    [t(p + "mlp.gate_proj.weight", f, d), t(p + "mlp.up_proj.weight", f, d)], axis=0
                ),
                "w_down": t(p + "mlp.down_proj.weight", d, f),
            }
        )
    net = {
        "fc": t("fc.weight", d, len(ids) * target_hidden),
        "hidden_norm": t("hidden_norm.weight", d),
        "norm": t("norm.weight", d),
        "layers": layers,
    }
    meta = {
        "hidden_size": target_hidden,
        "vocab_size": config.vocab_size,
        "target_layers": ids,
        "block_size": block,
        "mask_token_id": int(mask),
    }
    if target_hidden != d:
        raise CheckpointError(
            f"{path}: the drafter's hidden_size {d} differs from the target's {target_hidden}; the block "
            "is embedded with the target's embedding, so they must agree"
        )
    return config, net, meta


def is_public_dflash_dir(path) -> bool:
    """A directory in the public DFlash format (config.json naming a DFlash drafter, safetensors)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = " ".join(raw.get("architectures") or [])
    return "DFlash" in archs or "dflash_config" in raw


def load_dflash(heads, target):
    """(drafter config, {"net", "embed", "lm_head"}, meta) of DFlash heads for `target` (a loaded
    model): a specjax "dflash" checkpoint, or a directory in the public DFlash format
    (`read_dflash`); weights in the target's dtype."""
    from specjax.checkpoint import CheckpointError
    from specjax.heads import check_compatible
    from specjax.model import lm_head_weight
    from specjax.proposers.eagle_net import cast_floats

    if is_public_dflash_dir(heads) and not (Path(heads) / "specjax.json").exists():
        config, net, meta = read_dflash(Path(heads))
        net = jax.tree_util.tree_map(jnp.asarray, net)
    else:
        config, net, meta = load_dflash_heads(heads)
    check_compatible(meta, target.config, heads)
    layers = tuple(int(i) for i in meta["target_layers"])
    if any(not 0 <= i < target.config.num_layers for i in layers):
        raise CheckpointError(
            f"DFlash heads {heads} read target layers {layers}, the target has {target.config.num_layers}"
        )
    if net["fc"].shape[1] != len(layers) * target.config.hidden_size:
        raise CheckpointError(
            f"DFlash heads {heads}: fc takes {net['fc'].shape[1]} features, "
            f"{len(layers)} target layers give {len(layers) * target.config.hidden_size}"
        )
    if not 0 <= int(meta["mask_token_id"]) < target.config.vocab_size:
        raise CheckpointError(f"DFlash heads {heads}: mask_token_id {meta['mask_token_id']} is outside the vocabulary")
    dtype = target.params["embed"].dtype
    params = {"net": cast_floats(net, dtype), "embed": target.params["embed"], "lm_head": lm_head_weight(target.params)}
    return config, params, {**meta, "target_layers": layers}
