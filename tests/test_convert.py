"""Checkpoint conversion and loading: HF <-> specjax round trips, .bin, sharded, broken tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from conftest import make_tiny_hf_model

from specjax import load_model
from specjax.checkpoint import CheckpointError
from specjax.cli import main

KINDS = {
    "llama": dict(tie_word_embeddings=True),
    "qwen2": dict(tie_word_embeddings=False),  # q/k/v projections carry biases
    "mistral": dict(tie_word_embeddings=False),
    # per-head q/k norms, head_dim 32 != hidden / heads, q/k/v and output biases
    "qwen3": dict(tie_word_embeddings=True, attention_bias=True),
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """kind -> (HF directory, torch model)."""
    out = {}
    for i, kind in enumerate(KINDS):
        d = tmp_path_factory.mktemp(f"hf_{kind}")
        # every tensor random (norms and biases too)
        out[kind] = (d, make_tiny_hf_model(d, kind, seed=i, perturb=0.05, **KINDS[kind]))
    return out


def assert_same_params(a, b, exact=True):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, path
        assert x.dtype == y.dtype, path
        if exact:
            assert np.array_equal(x, y), path
        else:
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7, err_msg=str(path))


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / a.abs().max())


# --------------------------------------------------------------------------- HF -> specjax -> HF


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_through_specjax(kind, hf_models, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    src, torch_model = hf_models[kind]
    a, b = tmp_path / "sj", tmp_path / "hf"
    assert main(["convert", str(src), "--out", str(a)]) == 0
    assert (a / "specjax.json").exists()
    assert json.loads((a / "specjax.json").read_text())["format"] == "specjax"
    cfg = torch_model.config
    d, hd = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    with safe_open(str(a / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        # specjax layout: [out, in], q/k/v fused along the output axis.
        assert f.get_tensor("layers.0.wqkv").shape == (q + 2 * kv, d)
    assert ("lm_head" in keys) == (not KINDS[kind]["tie_word_embeddings"])
    assert ("layers.1.bqkv" in keys) == (kind in ("qwen2", "qwen3"))
    assert ("layers.1.bo" in keys) == ("layers.1.q_norm" in keys) == ("layers.1.k_norm" in keys) == (kind == "qwen3")

    assert main(["convert", str(a), "--out", str(b)]) == 0  # specjax -> HF by default
    assert not (b / "specjax.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (b / name).read_bytes() == (src / name).read_bytes(), name
        assert (a / name).exists(), name
    assert (
        json.loads((b / "config.json").read_text())["architectures"]
        == json.loads((src / "config.json").read_text())["architectures"]
    )

    back = AutoModelForCausalLM.from_pretrained(str(b), dtype=torch.float32).eval()
    assert type(back) is type(torch_model)
    ids = torch.tensor([[1, 5, 17, 200, 33, 9, 310, 42, 7, 64, 128, 3]])
    with torch.no_grad():
        want = torch_model(ids).logits
        got = back(ids).logits
    assert got.dtype == torch.float32
    assert rel_err(want, got) < 1e-5
    if kind in ("qwen2", "qwen3"):  # the biases (and Qwen3's q/k norms) made it through
        attn, back_attn = torch_model.model.layers[0].self_attn, back.model.layers[0].self_attn
        names = ["q_proj.bias"] + (["o_proj.bias", "q_norm.weight", "k_norm.weight"] if kind == "qwen3" else [])
        for name in names:
            want = attn.get_parameter(name)
            assert torch.equal(back_attn.get_parameter(name), want) and want.std() > 0  # not ones or zeros

    # The round trip also loads in tokenizer form.
    from transformers import AutoTokenizer

    t_src = AutoTokenizer.from_pretrained(str(src))
    t_back = AutoTokenizer.from_pretrained(str(b))
    text = "Hello! How are you today?"
    assert t_back(text).input_ids == t_src(text).input_ids
    assert t_back.chat_template == t_src.chat_template


def test_convert_explicit_to_and_same_dir(hf_models, tmp_path, capsys):
    src, _ = hf_models["mistral"]
    # --to hf from an HF dir re-saves in HF layout.
    assert main(["convert", str(src), "--out", str(tmp_path / "h"), "--to", "hf"]) == 0
    assert not (tmp_path / "h" / "specjax.json").exists()
    assert_same_params(load_model(str(src)).params, load_model(str(tmp_path / "h")).params)
    # Converting onto the source directory is refused with one line.
    capsys.readouterr()
    assert main(["convert", str(src), "--out", str(src)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "source" in err[0]
    assert (src / "model.safetensors").exists()


def test_specjax_checkpoint_loads_identically(hf_models, tmp_path):
    for kind in ("llama", "qwen2", "qwen3"):
        src, _ = hf_models[kind]
        out = tmp_path / kind
        assert main(["convert", str(src), "--out", str(out)]) == 0
        from_hf, from_sj = load_model(str(src)), load_model(str(out))
        assert from_sj.config == from_hf.config
        assert_same_params(from_hf.params, from_sj.params)
        assert from_sj.tokenizer("hi there").input_ids == from_hf.tokenizer("hi there").input_ids


def test_version1_specjax_checkpoint_is_transposed_on_load(hf_models, tmp_path):
    """Checkpoints written before format version 2 hold linear weights [in, out]."""
    from safetensors.numpy import load_file, save_file

    from specjax.checkpoint import LINEAR_KEYS

    src, _ = hf_models["qwen2"]
    out = tmp_path / "v1"
    assert main(["convert", str(src), "--out", str(out)]) == 0
    flat = load_file(str(out / "model.safetensors"))
    save_file(
        {k: np.ascontiguousarray(v.T) if k.split(".")[-1] in LINEAR_KEYS else v for k, v in flat.items()},
        str(out / "model.safetensors"),
    )
    marker = json.loads((out / "specjax.json").read_text())
    assert marker["version"] == 2
    (out / "specjax.json").write_text(json.dumps({**marker, "version": 1}))
    assert_same_params(load_model(str(src)).params, load_model(str(out)).params)


# --------------------------------------------------------------------------- other HF layouts


def _copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    return dst


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_torch_bin_checkpoint(kind, hf_models, tmp_path):
    src, torch_model = hf_models[kind]
    d = _copy_without_weights(src, tmp_path / "bin")
    torch.save(torch_model.state_dict(), d / "pytorch_model.bin")
    assert not list(d.glob("*.safetensors"))
    assert_same_params(load_model(str(src)).params, load_model(str(d)).params)


def test_sharded_safetensors(hf_models, tmp_path):
    src, torch_model = hf_models["qwen2"]
    d = _copy_without_weights(src, tmp_path / "sharded")
    torch_model.save_pretrained(str(d), max_shard_size="50KB")
    assert (d / "model.safetensors.index.json").exists()
    shards = list(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert not (d / "model.safetensors").exists()
    assert_same_params(load_model(str(src)).params, load_model(str(d)).params)


def test_missing_shard_is_named(hf_models, tmp_path):
    src, torch_model = hf_models["qwen2"]
    d = _copy_without_weights(src, tmp_path / "sharded")
    torch_model.save_pretrained(str(d), max_shard_size="50KB")
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(str(d))


# --------------------------------------------------------------------------- broken tensors


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(hf_models, tmp_path, capsys):
    name = "model.layers.1.mlp.up_proj.weight"
    d = _edit_tensors(hf_models["mistral"][0], tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(str(d))
    # ... and through the CLI as one line.
    capsys.readouterr()
    assert main(["convert", str(d), "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0]
    assert not (tmp_path / "o").exists()


def test_missing_bias_is_named(hf_models, tmp_path):
    name = "model.layers.0.self_attn.k_proj.bias"
    d = _edit_tensors(hf_models["qwen2"][0], tmp_path / "nobias", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(str(d))


def test_wrong_shape_is_named(hf_models, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        assert t[name].shape == (32, 64)
        t[name] = np.zeros((64, 64), np.float32)

    d = _edit_tensors(hf_models["llama"][0], tmp_path / "shape", edit)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        load_model(str(d))
    assert "shape" in str(e.value)


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "TokenizersBackend", None])
def test_tokenizer_equals_autotokenizer_without_importing_torch(tmp_path, tokenizer_class):
    """A plain fast tokenizer loads without AutoTokenizer (which imports torch, seconds per
    command) and encodes, decodes and applies the chat template exactly as AutoTokenizer's."""
    import subprocess
    import sys

    from conftest import build_tokenizer
    from transformers import AutoTokenizer

    from specjax.loading import load_tokenizer

    build_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    config_path.write_text(json.dumps(config))
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "def add(a, b): return a + b"}]
    for text in ("The quick brown fox.", "1 + 1 = 2\n\tdone", "<|im_start|>hi<|im_end|>"):
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(ours(text).input_ids) == auto.decode(auto(text).input_ids)
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == auto.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert (ours.eos_token, ours.pad_token) == (auto.eos_token, auto.pad_token)
    if tokenizer_class:  # a fresh process: torch stays unimported
        probe = (
            "import sys; from pathlib import Path; from specjax.loading import load_tokenizer; "
            f"load_tokenizer(Path({str(tmp_path)!r})); print('torch' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "False"
