"""apple/ml-recurrent-drafter drafter checkpoints -> specjax ReDrafter heads.

The public format (`Drafter.save_pretrained`, recurrent_drafting/modeling_drafter.py) is a
directory with `config.json` (model_type `recurrent_drafting_drafter`; `vocab_size`,
`hidden_size`, `exit_dim`, `num_draft_layers`, `rnn`) and `model.safetensors` (or
`pytorch_model.bin`; TensorRT-LLM's converter also reads `model.pt`) holding PyTorch Linear
weights [out, in]:

    input_proj.weight/.bias      [exit_dim, 2 * hidden]   only when exit_dim != 2 * hidden
    lm_head.{i}.linear.weight/.bias [exit_dim, exit_dim]  ResBlocks, i < num_draft_layers
    lm_head.{num_draft_layers}.weight [vocab, exit_dim]   the drafter's vocabulary projection
    rnn_u.weight/.bias, rnn_w.weight  [hidden, hidden]    only when rnn

TensorRT-LLM's converter (examples/redrafter/convert_checkpoint.py) also accepts the prefixes
`lm_heads.` / `input_projs.` and `0.` for the head; so does this one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specjax.checkpoint import CheckpointError, read_json, read_safetensors, read_torch_bin, tensor_access
from specjax.heads import save_heads

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt")
MODEL_TYPE = "recurrent_drafting_drafter"
HEAD_PREFIXES = ("lm_head.", "lm_heads.", "0.")
PROJ_PREFIXES = ("input_proj.", "input_projs.")


def is_redrafter_dir(path) -> bool:
    """A directory whose config.json describes an apple/ml-recurrent-drafter drafter."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    try:
        cfg = read_json(path / "config.json")
    except Exception:
        return False
    return cfg.get("model_type") == MODEL_TYPE or ("exit_dim" in cfg and "num_draft_layers" in cfg and "rnn" in cfg)


def read_redrafter(path) -> tuple[dict, dict]:
    """(meta, drafter params) from an apple/ml-recurrent-drafter directory."""
    path = Path(path)
    cfg = read_json(path / "config.json")
    for key in ("hidden_size", "vocab_size", "num_draft_layers"):
        if int(cfg.get(key, -1)) < 0:
            raise CheckpointError(f"{path / 'config.json'} lacks a valid '{key}'")
    d, v, n = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_draft_layers"])
    e = int(cfg.get("exit_dim", -1))
    e = 2 * d if e <= 0 else e
    rnn = bool(cfg.get("rnn", False))
    weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights is None:
        raise CheckpointError(f"no ReDrafter weights ({', '.join(WEIGHT_FILES)}) in {path}")
    sd = read_safetensors(weights) if weights.suffix == ".safetensors" else read_torch_bin(weights)
    get, expect = tensor_access(sd, str(weights))

    def pick(prefixes, rest):
        for p in prefixes:
            if p + rest in sd:
                return p + rest
        return prefixes[0] + rest  # absent: `get` names the reference's spelling

    def linear(name, n_in, n_out, bias=True):
        w = expect(name + "weight", get(name + "weight"), (n_out, n_in))
        out = {"kernel": np.ascontiguousarray(w.T)}
        if bias:
            out["bias"] = expect(name + "bias", get(name + "bias"), (n_out,))
        return out

    used = set()
    params = {"resblocks": {}}
    for i in range(n):
        name = pick(HEAD_PREFIXES, f"{i}.linear.weight")[: -len("weight")]
        params["resblocks"][str(i)] = linear(name, e, e)
        used |= {name + "weight", name + "bias"}
    name = pick(HEAD_PREFIXES, f"{n}.weight")
    params["lm_head"] = expect(name, get(name), (v, e))
    used.add(name)
    if e != 2 * d:
        name = pick(PROJ_PREFIXES, "weight")[: -len("weight")]
        params["input_proj"] = linear(name, 2 * d, e)
        used |= {name + "weight", name + "bias"}
    if rnn:
        params["rnn_u"] = linear("rnn_u.", d, d)
        params["rnn_w"] = linear("rnn_w.", d, d, bias=False)
        used |= {"rnn_u.weight", "rnn_u.bias", "rnn_w.weight"}
    unknown = sorted(set(sd) - used)
    if unknown:
        raise CheckpointError(
            f"unexpected tensor '{unknown[0]}' in {weights} (config: num_draft_layers {n}, exit_dim {e}, rnn {rnn})"
        )
    if not params["resblocks"]:
        del params["resblocks"]
    meta = {
        "hidden_size": d,
        "vocab_size": v,
        "exit_dim": e,
        "num_draft_layers": n,
        "rnn": rnn,
        "source": "apple/ml-recurrent-drafter",
    }
    return meta, params


def convert_redrafter(src, out) -> Path:
    meta, params = read_redrafter(Path(src))
    return save_heads(out, "redrafter", params, meta)
