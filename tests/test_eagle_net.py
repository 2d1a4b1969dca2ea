"""EAGLE draft network: SafeAILab-format heads convert and compute what the PyTorch layer computes."""

from __future__ import annotations

import json
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax import PagedKVCache, causal_mask
from specjax.cache import init_pages
from specjax.convert.eagle import convert_eagle, is_eagle_dir
from specjax.proposers.eagle_net import eagle_forward, load_eagle_heads

D, V, T = 64, 320, 9


def make_eagle_dir(d, hidden_size=D, seed=0):
    """A SafeAILab-format EAGLE head directory with random weights; (dir, config, layer, fc)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    D = hidden_size
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    fc = torch.nn.Linear(2 * D, D, bias=True)
    with torch.no_grad():
        for p in list(layer.parameters()) + list(fc.parameters()):
            p.add_(0.05 * torch.randn_like(p))
    sd = {f"layers.0.{k}": v for k, v in layer.state_dict().items() if not k.startswith("input_layernorm")}
    sd.update({"fc.weight": fc.weight.data, "fc.bias": fc.bias.data, "embed_tokens.weight": torch.randn(V, D)})
    torch.save(sd, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    return d, cfg, layer, fc


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    return make_eagle_dir(tmp_path_factory.mktemp("eagle"))


def test_detect_and_convert(eagle_dir, tmp_path):
    d, cfg, _, _ = eagle_dir
    assert is_eagle_dir(d)
    config, params = load_eagle_heads(convert_eagle(d, tmp_path / "sj"))
    assert config.num_layers == 1 and "attn_norm" not in params["layers"][0]
    assert params["fc"]["kernel"].shape == (2 * D, D)


def test_version1_heads_are_transposed_on_load(eagle_dir, tmp_path):
    """Head checkpoints written before format version 2 hold decoder layers [in, out]."""
    from safetensors.numpy import load_file, save_file

    from specjax.checkpoint import LINEAR_KEYS
    from specjax.heads import HEADS_FILE

    out = convert_eagle(eagle_dir[0], tmp_path / "sj")
    _, want = load_eagle_heads(out)
    flat = load_file(str(out / HEADS_FILE))
    assert flat["layers/0/wqkv"].shape[1] == D  # [out, in]
    save_file(
        {k: np.ascontiguousarray(v.T) if k.split("/")[-1] in LINEAR_KEYS else v for k, v in flat.items()},
        str(out / HEADS_FILE),
    )
    marker = json.loads((out / "specjax.json").read_text())
    (out / "specjax.json").write_text(json.dumps({**marker, "version": 1}))
    _, got = load_eagle_heads(out)
    for k in ("wqkv", "wo", "w_gate_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(got["layers"][0][k]), np.asarray(want["layers"][0][k]))
    np.testing.assert_array_equal(np.asarray(got["fc"]["kernel"]), np.asarray(want["fc"]["kernel"]))


def test_forward_matches_pytorch(eagle_dir, tmp_path):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d, cfg, layer, fc = eagle_dir
    config, params = load_eagle_heads(convert_eagle(d, tmp_path / "sj"))
    embed = torch.randn(V, D)
    tokens = torch.randint(0, V, (2, T))
    feats = torch.randn(2, T, D)
    with torch.no_grad():
        x = fc(torch.cat([embed[tokens], feats], dim=-1))
        layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer has no input norm
        pos = torch.arange(T)[None].expand(2, T)
        cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        want = (out[0] if isinstance(out, tuple) else out).numpy()
    k, v = init_pages(config, 8, 4)
    cache = PagedKVCache(k, v, jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32), jnp.zeros(2, jnp.int32))
    got, _ = eagle_forward(
        params,
        config,
        jnp.asarray(embed.numpy()),
        jnp.asarray(tokens.numpy()),
        jnp.asarray(feats.numpy()),
        jnp.broadcast_to(jnp.arange(T), (2, T)),
        cache,
        causal_mask(2, T),
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_specjax_convert_detects_eagle(eagle_dir, tmp_path, tiny_llama):
    from specjax.cli import main

    d, _, _, _ = eagle_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "h")]) == 0
    assert json.loads((tmp_path / "h" / "specjax.json").read_text())["kind"] == "eagle"
    assert not is_eagle_dir(tiny_llama[0])  # a full model directory is not EAGLE heads


def _cli_tokens(capsys, args):
    from specjax.cli import main

    assert main(args) == 0
    return [json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()]


def test_generate_with_eagle_heads_equals_vanilla(eagle_dir, tmp_path, tiny_llama, capsys):
    """`--method eagle|eagle2 --heads` with converted heads: same tokens as vanilla decoding."""
    d, _, _, _ = eagle_dir
    convert_eagle(d, tmp_path / "sj")
    base = [
        "generate",
        "--model",
        str(tiny_llama[0]),
        "--raw",
        "--json",
        "--max-new-tokens",
        "20",
        "--prompt",
        "The quick brown fox",
        "--prompt",
        "def add(a, b):",
        "--batch-size",
        "2",
    ]
    vanilla = _cli_tokens(capsys, base)
    heads = ["--heads", str(tmp_path / "sj")]
    assert _cli_tokens(capsys, base + ["--method", "eagle"] + heads) == vanilla
    assert _cli_tokens(capsys, base + ["--method", "eagle", "--eagle-choices", "[[0, 0], [1]]"] + heads) == vanilla
    assert (
        _cli_tokens(
            capsys,
            base
            + ["--method", "eagle2", "--eagle-total-tokens", "10", "--eagle-depth", "3", "--eagle-top-k", "3"]
            + heads,
        )
        == vanilla
    )
    assert _cli_tokens(capsys, base + ["--method", "eagle2", "--eagle-draft-vocab", "64"] + heads) == vanilla


@pytest.mark.parametrize(
    "case,words",
    [
        ("no-heads", ["needs --heads"]),
        ("hidden", ["hidden_size 32", "64"]),
        ("kind", ["not a specjax head checkpoint"]),
        ("eagle2-opt-to-eagle", ["EAGLE-2 options"]),
        ("too-many", ["exceeds"]),
        ("vocab", ["draft vocabulary size", "320"]),
    ],
)
def test_eagle_errors(eagle_dir, tmp_path, tiny_llama, capsys, case, words):
    from specjax.cli import main

    d, _, _, _ = eagle_dir
    convert_eagle(d, tmp_path / "sj")
    args = [
        "generate",
        "--model",
        str(tiny_llama[0]),
        "--raw",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
        "--method",
        "eagle2",
    ]
    if case == "hidden":
        small = tmp_path / "small"
        small.mkdir()
        convert_eagle(make_eagle_dir(small, hidden_size=32)[0], tmp_path / "sj32")
        args += ["--heads", str(tmp_path / "sj32")]
    elif case == "kind":
        args += ["--heads", str(tiny_llama[0])]
    elif case == "eagle2-opt-to-eagle":
        args[-1] = "eagle"
        args += ["--heads", str(tmp_path / "sj"), "--eagle-depth", "2"]
    elif case == "vocab":
        args += ["--heads", str(tmp_path / "sj"), "--eagle-draft-vocab", "1000"]
    elif case == "too-many":
        args += [
            "--heads",
            str(tmp_path / "sj"),
            "--eagle-total-tokens",
            "100",
            "--eagle-depth",
            "1",
            "--eagle-top-k",
            "2",
        ]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_heads_recommend_decoding_defaults(eagle_dir, tmp_path, tiny_llama):
    """Options left unset take the head checkpoint's `decoding_defaults`; given ones win."""
    from specjax import load_model
    from specjax.methods import make_proposer

    d, _, _, _ = eagle_dir
    out = convert_eagle(d, tmp_path / "sj")
    meta = json.loads((out / "specjax.json").read_text())
    meta["decoding_defaults"] = {
        "eagle2": {"eagle_total_tokens": 6, "eagle_depth": 2, "eagle_top_k": 2, "eagle_draft_vocab": 40}
    }
    (out / "specjax.json").write_text(json.dumps(meta))
    model = load_model(str(tiny_llama[0]))
    p, params = make_proposer("eagle2", model, heads=str(out))
    assert (p.total_tokens, p.depth, p.top_k) == (6, 2, 2)
    assert params["lm_head"].shape[0] == params["draft_ids"].shape[0] == 40
    p, params = make_proposer("eagle2", model, heads=str(out), eagle_total_tokens=5, eagle_draft_vocab=24)
    assert (p.total_tokens, p.depth, p.top_k) == (5, 2, 2)
    assert params["lm_head"].shape[0] == 24
    p, _ = make_proposer("eagle", model, heads=str(out))  # nothing recommended for EAGLE-1
    assert p.tree_size == 26
    with mock.patch("jax.default_backend", return_value="gpu"):  # CPU-tuned: not on a GPU
        p, _ = make_proposer("eagle2", model, heads=str(out))
    assert (p.total_tokens, p.depth, p.top_k) == (63, 5, 8)


def test_draft_weights_take_their_setting_on_the_cpu_kernel_and_output_stays_vanilla(eagle_dir, tmp_path, tiny_llama):
    """On the CPU matmul kernel the draft's own matrices (fc, layers, its lm_head rows) are
    packed for it in the draft weights setting's type (auto: DRAFT_AUTO; float32, float16 or
    int8: fewer bytes per draft pass).
    Either way the target's embedding is untouched and greedy output equals vanilla."""
    import jax

    from specjax import Engine, load_model
    from specjax.cpu.draft_weights import DRAFT_AUTO, use_draft_weights
    from specjax.cpu.matmul import PackedWeight, kernel_in_use
    from specjax.methods import make_proposer

    d, _, _, _ = eagle_dir
    out = convert_eagle(d, tmp_path / "sj")
    model = load_model(str(tiny_llama[0]))
    prompts = [[3, 17, 42, 5, 9], [11, 2, 7]]
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    vanilla = eng.generate(prompts, 12, eos_token_ids=()).token_ids
    on = lambda dtype: dtype if kernel_in_use() else jnp.float32
    for setting, want in (
        ("auto", on(DRAFT_AUTO)),
        ("float32", jnp.float32),
        ("float16", on(jnp.float16)),
        ("int8", on(jnp.int8)),
    ):
        with use_draft_weights(setting):
            p, params = make_proposer(
                "eagle2", model, heads=str(out), eagle_total_tokens=6, eagle_depth=3, eagle_top_k=2
            )
        mats = [
            a
            for a in jax.tree_util.tree_leaves(params["net"], is_leaf=lambda a: isinstance(a, PackedWeight))
            if a.ndim == 2
        ]
        assert mats and {a.dtype for a in mats} == {jnp.dtype(want)}
        assert all(isinstance(a, PackedWeight) for a in mats) == kernel_in_use()
        assert params["lm_head"].dtype == want and params["embed"].dtype == jnp.float32
        spec = eng.generate(prompts, 12, eos_token_ids=(), proposer=p, proposer_params=params)
        assert spec.token_ids == vanilla
