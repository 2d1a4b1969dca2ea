"""EAGLE-3 draft network: SafeAILab-format heads convert and compute what the PyTorch layer computes."""

from __future__ import annotations

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax import PagedKVCache, causal_mask
from specjax.cache import init_pages
from specjax.checkpoint import CheckpointError
from specjax.convert.eagle import is_eagle_dir
from specjax.convert.eagle3 import convert_eagle3, is_eagle3_dir, read_eagle3
from specjax.convert.hf import convert_checkpoint
from specjax.heads import check_compatible
from specjax.model_config import ModelConfig
from specjax.proposers.eagle3_net import (
    draft_to_target,
    eagle3_feature_layers,
    eagle3_forward,
    eagle3_fuse,
    eagle3_logprobs,
    feature_layers_of,
    init_eagle3_params,
    load_eagle3_heads,
    save_eagle3_heads,
)

D, H, KVH, F, V, VD = 64, 4, 2, 128, 320, 96
HD = D // H
EPS, THETA = 1e-5, 1000.0
CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": D,
    "intermediate_size": F,
    "max_position_embeddings": 2048,
    "num_attention_heads": H,
    "num_key_value_heads": KVH,
    "num_hidden_layers": 1,
    "rms_norm_eps": EPS,
    "rope_theta": THETA,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": V,
    "draft_vocab_size": VD,
}


def _state_dict(seed=0):
    """Random tensors with the names and shapes of a SafeAILab EAGLE-3 head (incl. d2t/t2d)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, s=0.1):
        return s * torch.randn(*shape, generator=g)

    def norm():
        return 1 + w(D)

    kept = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    m = "midlayer."
    return {
        "fc.weight": w(D, 3 * D),
        m + "input_layernorm.weight": norm(),
        m + "hidden_norm.weight": norm(),
        m + "self_attn.q_proj.weight": w(H * HD, 2 * D),
        m + "self_attn.k_proj.weight": w(KVH * HD, 2 * D),
        m + "self_attn.v_proj.weight": w(KVH * HD, 2 * D),
        m + "self_attn.o_proj.weight": w(D, H * HD),
        m + "post_attention_layernorm.weight": norm(),
        m + "mlp.gate_proj.weight": w(F, D),
        m + "mlp.up_proj.weight": w(F, D),
        m + "mlp.down_proj.weight": w(D, F),
        "norm.weight": norm(),
        "lm_head.weight": w(VD, D, s=0.5),
        "d2t": kept - torch.arange(VD),
        "t2d": torch.isin(torch.arange(V), kept),
    }


def _write(d, sd, config=CONFIG, safetensors=False):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    else:
        torch.save(sd, d / "pytorch_model.bin")
    return d


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    sd = _state_dict()
    return _write(tmp_path_factory.mktemp("eagle3") / "head", sd), sd


# ----------------------------------------------------------------- PyTorch reference of the layer


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, pos):  # x [N, heads, HD], rotate-half layout
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., HD // 2 :], x[..., : HD // 2]], -1)
    return x * cos + rot * sin


def ref_layer(sd, emb, h, pos, mask):
    """EAGLE-3 midlayer over N tokens: emb, h [N, D], pos [N], mask bool [N query, N key]."""
    m = "midlayer."
    n = h.shape[0]
    x_in = torch.cat([_rms(emb, sd[m + "input_layernorm.weight"]), _rms(h, sd[m + "hidden_norm.weight"])], -1)
    q = _rope((x_in @ sd[m + "self_attn.q_proj.weight"].T).view(n, H, HD), pos)
    k = _rope((x_in @ sd[m + "self_attn.k_proj.weight"].T).view(n, KVH, HD), pos)
    v = (x_in @ sd[m + "self_attn.v_proj.weight"].T).view(n, KVH, HD)
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(HD)
    p = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
    x = h + torch.einsum("hnm,mhd->nhd", p, v).reshape(n, -1) @ sd[m + "self_attn.o_proj.weight"].T
    y = _rms(x, sd[m + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(y @ sd[m + "mlp.gate_proj.weight"].T) * (y @ sd[m + "mlp.up_proj.weight"].T)
    return x + act @ sd[m + "mlp.down_proj.weight"].T


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ------------------------------------------------------------------------------------------ tests


def test_feature_layers():
    assert eagle3_feature_layers(32) == (1, 15, 28)  # inputs of layers 2, 16, 29 (SafeAILab)
    assert eagle3_feature_layers(30) == (1, 14, 26)  # SmolLM2-135M
    assert eagle3_feature_layers(2) == (0, 0, 1)  # tiny test targets: nearest valid layers
    assert feature_layers_of({"feature_layers": None}, 30) == (1, 14, 26)
    assert feature_layers_of({"feature_layers": [3, 5, 7]}, 30) == (3, 5, 7)
    with pytest.raises(ValueError):
        feature_layers_of({"feature_layers": [3, 5, 40]}, 30)


def test_detection(eagle3_dir, tmp_path):
    d, _ = eagle3_dir
    assert is_eagle3_dir(d) and not is_eagle_dir(d)
    eagle1 = {"fc.weight": torch.zeros(D, 2 * D), "layers.0.self_attn.q_proj.weight": torch.zeros(D, D)}
    e1 = _write(tmp_path / "e1", eagle1, {**CONFIG, "architectures": ["LlamaForCausalLM"]})
    assert is_eagle_dir(e1) and not is_eagle3_dir(e1)
    assert not is_eagle3_dir(tmp_path)  # no config.json


def test_forward_matches_pytorch(eagle3_dir, tmp_path):
    d, sd = eagle3_dir
    out = convert_checkpoint(d, tmp_path / "sj")  # what `specjax convert` runs
    assert json.loads((out / "specjax.json").read_text())["kind"] == "eagle3"
    config, params, meta = load_eagle3_heads(out)
    assert config.num_layers == 1 and config.rope_theta == THETA
    assert (meta["hidden_size"], meta["vocab_size"], meta["draft_vocab_size"]) == (D, V, VD)
    check_compatible(meta, ModelConfig(V, D, F, 30, H, KVH, HD), out)

    g = torch.Generator().manual_seed(1)
    b, t1 = 2, 7
    embed = torch.randn(V, D, generator=g)
    tokens = torch.randint(0, V, (b, t1 + 4), generator=g)
    feats3 = torch.randn(b, t1, 3 * D, generator=g)
    feats_tree = torch.randn(b, 4, D, generator=g)  # the draft's own previous outputs
    n_real = [t1, t1 - 2]  # sequence 1 ends in two padding tokens

    # specjax: prefill chunk, then two tree levels written at explicit scratch slots.
    k, v = init_pages(config, 8, 4)
    k, v = [jnp.full_like(k[0], jnp.nan)], [jnp.full_like(v[0], jnp.nan)]  # unwritten = NaN
    tables = jnp.asarray([[5, 1, 7, 2], [0, 6, 3, 4]], jnp.int32)
    cache = PagedKVCache(k, v, tables, jnp.zeros(b, jnp.int32))
    fwd = jax.jit(eagle3_forward, static_argnums=1)
    e, tok = jnp.asarray(embed.numpy()), jnp.asarray(tokens.numpy())
    fused = eagle3_fuse(params, jnp.asarray(feats3.numpy()))
    valid = jnp.arange(t1)[None, :] < jnp.asarray(n_real)[:, None]
    out1, cache = fwd(
        params,
        config,
        e,
        tok[:, :t1],
        fused,
        jnp.broadcast_to(jnp.arange(t1), (b, t1)),
        cache,
        causal_mask(b, t1),
        valid,
    )
    lengths = jnp.asarray(n_real, jnp.int32)
    cache = cache.replace(lengths=lengths)
    tree_tok = jnp.stack([tok[i, n_real[i] : n_real[i] + 4] for i in range(b)])
    ft = jnp.asarray(feats_tree.numpy())
    level1 = jnp.asarray([[1, 0, 0, 0], [0, 1, 0, 0]], bool)
    level2 = jnp.asarray([[1, 0, 1, 0], [0, 1, 0, 1]], bool)  # node 2 <- node 0, node 3 <- node 1
    outs = []
    for lvl, mask in enumerate((level1, level2)):
        cols = jnp.arange(2 * lvl, 2 * lvl + 2)
        o, cache = fwd(
            params,
            config,
            e,
            tree_tok[:, cols],
            ft[:, cols],
            jnp.broadcast_to(lengths[:, None] + lvl, (b, 2)),
            cache,
            jnp.broadcast_to(mask, (b, 2, 4)),
            slots=lengths[:, None] + cols[None, :],
        )
        outs.append(o)
    tree_out = jnp.concatenate(outs, axis=1)
    assert np.isfinite(np.asarray(tree_out)).all()

    with torch.no_grad():
        fused_ref = feats3 @ sd["fc.weight"].T
        assert rel_err(fused, fused_ref) < 1e-5
        for i in range(b):
            n = n_real[i]
            h = torch.cat([fused_ref[i, :n], feats_tree[i]])
            ids = torch.cat([tokens[i, :n], torch.tensor(np.asarray(tree_tok[i]))])
            pos = torch.cat([torch.arange(n), torch.tensor([n, n, n + 1, n + 1])])
            mask = torch.zeros(n + 4, n + 4, dtype=torch.bool)
            mask[:, :n] = True
            mask[:n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            for node, anc in ((0, [0]), (1, [1]), (2, [0, 2]), (3, [1, 3])):
                mask[n + node, [n + a for a in anc]] = True
            want = ref_layer(sd, embed[ids], h, pos, mask)
            assert rel_err(out1[i, :n], want[:n]) < 1e-4
            assert rel_err(tree_out[i], want[n:]) < 1e-4

            # Draft log-probs through norm + the draft lm_head; ids mapped to the target vocab.
            lp = eagle3_logprobs(params, config, tree_out[i])
            want_lp = torch.log_softmax(_rms(want[n:], sd["norm.weight"]) @ sd["lm_head.weight"].T, -1)
            chex.assert_shape(lp, (4, VD))
            chex.assert_type(lp, jnp.float32)
            assert rel_err(lp, want_lp) < 1e-4
            top = jax.lax.top_k(lp, 5)[1]
            want_top = want_lp.topk(5).indices
            assert np.array_equal(np.asarray(top), want_top.numpy())
            got_ids = np.asarray(draft_to_target(params, top))
            assert np.array_equal(got_ids, (want_top + sd["d2t"][want_top]).numpy())
            full = torch.full((4, V), float("-inf"))  # vLLM's scatter into target-vocab logits
            full[:, torch.arange(VD) + sd["d2t"]] = want_lp
            assert np.array_equal(got_ids[:, 0], full.argmax(-1).numpy())
            assert sd["t2d"][torch.tensor(got_ids)].all()


def test_own_embedding_and_safetensors(tmp_path):
    """A head carrying `embed_tokens.weight` drafts with it, whatever embedding the caller passes."""
    sd = _state_dict(seed=3)
    sd["embed_tokens.weight"] = torch.randn(V, D)
    d = _write(tmp_path / "own", sd, safetensors=True)
    assert is_eagle3_dir(d)
    config, params, _ = load_eagle3_heads(convert_eagle3(d, tmp_path / "sj"))
    assert params["d2t"].dtype == jnp.int32
    t = 5
    tokens = torch.randint(0, V, (1, t))
    h = torch.randn(1, t, D)
    k, v = init_pages(config, 2, 4)
    cache = PagedKVCache(k, v, jnp.asarray([[0, 1]], jnp.int32), jnp.zeros(1, jnp.int32))
    got, _ = eagle3_forward(
        params,
        config,
        jnp.zeros((V, D)),
        jnp.asarray(tokens.numpy()),
        jnp.asarray(h.numpy()),
        jnp.arange(t)[None],
        cache,
        causal_mask(1, t),
    )
    with torch.no_grad():
        want = ref_layer(
            sd,
            sd["embed_tokens.weight"][tokens[0]],
            h[0],
            torch.arange(t),
            torch.tril(torch.ones(t, t, dtype=torch.bool)),
        )
    assert rel_err(got[0], want) < 1e-4


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_init_save_load(tmp_path, arch):
    qwen3 = dict(qk_norm=True, o_proj_bias=True) if arch == "Qwen3ForCausalLM" else {}
    target = ModelConfig(V, D, F, 12, H, KVH, HD, rope_theta=THETA, architecture=arch, attention_bias=True, **qwen3)
    counts = np.zeros(V)
    counts[[7, 300, 5, 100]] = [10, 9, 8, 7]
    config, params = init_eagle3_params(jax.random.PRNGKey(0), target, 4, token_counts=counts)
    assert config.num_layers == 1 and not config.attention_bias and config.hidden_size == D
    assert not config.qk_norm and not config.o_proj_bias  # a Llama layer, whatever the target
    assert np.array_equal(np.asarray(draft_to_target(params, jnp.arange(4))), [5, 7, 100, 300])
    _, first = init_eagle3_params(jax.random.PRNGKey(0), target, 4)
    assert np.array_equal(np.asarray(draft_to_target(first, jnp.arange(4))), [0, 1, 2, 3])
    out = save_eagle3_heads(tmp_path / "h", config, params, {"feature_layers": list(eagle3_feature_layers(12))})
    config2, params2, meta = load_eagle3_heads(out)
    assert config2 == config
    assert meta["feature_layers"] == [1, 5, 8] and meta["draft_vocab_size"] == 4
    chex.assert_trees_all_equal(params2, params)
    chex.assert_trees_all_equal_dtypes(params2, params)
    check_compatible(meta, target, out)
    with pytest.raises(CheckpointError, match="vocab_size"):
        check_compatible(meta, ModelConfig(V + 1, D, F, 12, H, KVH, HD), out)


def _one_line_error(d, match):
    with pytest.raises(CheckpointError, match=match) as err:
        read_eagle3(d)
    assert "\n" not in str(err.value)


def test_bad_inputs(tmp_path, capsys):
    from specjax.cli import main

    nothing = tmp_path / "none"
    nothing.mkdir()
    (nothing / "config.json").write_text(json.dumps(CONFIG))
    _one_line_error(nothing, "no EAGLE-3 weights")

    sd = _state_dict()
    sd["midlayer.self_attn.q_proj.weight"] = torch.zeros(H * HD, D)  # EAGLE-1 width, not 2D
    bad = _write(tmp_path / "shape", sd)
    _one_line_error(bad, r"'midlayer.self_attn.q_proj.weight' has shape \(64, 64\)")
    assert main(["convert", str(bad), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q_proj" in err[0]

    sd = _state_dict()
    del sd["midlayer.hidden_norm.weight"]
    _one_line_error(_write(tmp_path / "missing", sd), "lacks tensor 'midlayer.hidden_norm.weight'")

    sd = _state_dict()
    sd["t2d"] = ~sd["t2d"]
    _one_line_error(_write(tmp_path / "t2d", sd), "disagree")

    sd = _state_dict()
    del sd["d2t"]
    _one_line_error(_write(tmp_path / "d2t", sd), "lacks tensor 'd2t'")

    _one_line_error(_write(tmp_path / "layers", _state_dict(), {**CONFIG, "num_hidden_layers": 2}), "2 layers")


def test_generate_with_eagle3_heads_equals_vanilla(eagle3_dir, tmp_path, tiny_llama, capsys):
    """`--method eagle3 --heads` with converted SafeAILab heads decodes exactly like vanilla;
    EAGLE-1 heads given to eagle3 are refused by name."""
    from specjax.cli import main

    d = eagle3_dir[0]
    assert main(["convert", str(d), "--out", str(tmp_path / "sj")]) == 0
    base = [
        "generate",
        "--model",
        str(tiny_llama[0]),
        "--raw",
        "--json",
        "--max-new-tokens",
        "16",
        "--prompt",
        "The quick brown fox",
        "--prompt",
        "1 + 1 =",
        "--batch-size",
        "2",
    ]
    capsys.readouterr()
    outs = []
    for extra in (
        [],
        [
            "--method",
            "eagle3",
            "--heads",
            str(tmp_path / "sj"),
            "--eagle-total-tokens",
            "8",
            "--eagle-depth",
            "2",
            "--eagle-top-k",
            "3",
        ],
    ):
        assert main(base + extra) == 0
        outs.append([json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()])
    assert outs[0] == outs[1]
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_llama[0]),
                "--raw",
                "--prompt",
                "hi",
                "--method",
                "eagle2",
                "--heads",
                str(tmp_path / "sj"),
            ]
        )
        == 1
    )
    assert "holds eagle3 heads, not eagle heads" in capsys.readouterr().err
