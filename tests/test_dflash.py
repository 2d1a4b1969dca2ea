"""DFlash: the block drafter against a dense re-derivation of the reference's forward, greedy
output equal to vanilla (random drafter, and a built one whose drafts pass), the best-first
(DDTree) tree against brute force, the public checkpoint format's converter, the method's options."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import Engine, ModelConfig, init_params
from specjax.accept import AcceptResult
from specjax.cache import init_pages
from specjax.loading import Model
from specjax.model import lm_head_weight
from specjax.proposers.dflash import DFlashProposer, best_first_tree
from specjax.proposers.dflash_net import default_target_layers, draft_config, init_dflash_params
from specjax.spec_decode import SpecContext

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)
PROMPTS = [[3, 9, 27, 17, 51, 25, 11, 33, 35, 41], [5, 5, 5, 6], [1, 2]]
MASK = CFG.vocab_size - 1
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5)


def random_drafter(target, layers=2, scale=0.3, seed=3):
    dc = draft_config(CFG, layers)
    net = init_dflash_params(jax.random.PRNGKey(seed), dc, len(LAYERS), CFG.hidden_size, scale=scale)
    # norms off one, so a weight read in the wrong place shows
    net = jax.tree_util.tree_map_with_path(
        lambda p, a: a * (1 + 0.3 * jnp.sin(jnp.arange(a.size).reshape(a.shape))) if "norm" in str(p) else a, net
    )
    return dc, {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}


# --- the forward against the reference's math, written densely in numpy --------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta, hd):
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def dense_block_logits(net, dc, embed, lm_head, feats, tokens):
    """The reference's DFlashDraftModel.forward for one sequence, densely: context = the target
    features of positions 0..C-1, the block at C..C+K-1; every block slot attends to the context's
    and the block's keys (k_proj/v_proj of the fused context and of the normed block input)."""
    net = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), net)
    embed, lm_head, feats = (np.asarray(a, np.float64) for a in (embed, lm_head, feats))
    c, k = feats.shape[0], len(tokens)
    eps, hd, nh, nkv = dc.rms_norm_eps, dc.head_dim, dc.num_heads, dc.num_kv_heads
    ctx = _rms(feats @ net["fc"].T, net["hidden_norm"], eps)
    pos_ctx, pos_blk = np.arange(c), c + np.arange(k)
    h = embed[np.asarray(tokens)]
    for layer in net["layers"]:
        x = _rms(h, layer["attn_norm"], eps)
        q = _rope(_rms((x @ layer["wq"].T).reshape(k, nh, hd), layer["q_norm"], eps), pos_blk, dc.rope_theta, hd)
        src = np.concatenate([ctx, x])
        wk, wv = layer["wkv"][: nkv * hd], layer["wkv"][nkv * hd :]
        keys = _rms((src @ wk.T).reshape(c + k, nkv, hd), layer["k_norm"], eps)
        keys = _rope(keys, np.concatenate([pos_ctx, pos_blk]), dc.rope_theta, hd)
        vals = (src @ wv.T).reshape(c + k, nkv, hd)
        rep = nh // nkv
        keys, vals = np.repeat(keys, rep, 1), np.repeat(vals, rep, 1)
        s = np.einsum("qhd,khd->hqk", q, keys) / np.sqrt(hd)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", p, vals).reshape(k, nh * hd) @ layer["wo"].T
        gu = _rms(h, layer["mlp_norm"], eps) @ layer["w_gate_up"].T
        g, u = gu[:, : dc.intermediate_size], gu[:, dc.intermediate_size :]
        h = h + (g / (1 + np.exp(-g)) * u) @ layer["w_down"].T
    return _rms(h, net["norm"], eps)[1:] @ lm_head.T


def test_block_forward_matches_the_dense_reference(target):
    """After init (the prompt's features) and an update (an accepted path), the paged, cached
    drafter gives the dense forward's logits over the whole context, for each of two sequences."""
    dc, params = random_drafter(target)
    prop = DFlashProposer(dc, target_layers=LAYERS, mask_token_id=MASK, block_size=5)
    b, w, page = 2, 9, 4
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(b, w + 4, len(LAYERS) * CFG.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, MASK, size=(b, 24)).astype(np.int32)
    prompt_len = jnp.asarray([w, 6], jnp.int32)  # context of 9 and 6 tokens
    tables = jnp.arange(b * 6, dtype=jnp.int32).reshape(b, 6)
    pools = init_pages(dc, b * 6, page)
    ctx = SpecContext(jnp.asarray(tokens), prompt_len + 1, tables, prompt_hidden=jnp.asarray(feats[:, :w]))
    state = jax.jit(prop.init)(params, pools, ctx, jnp.asarray(tokens[:, :w]), prompt_len)
    logits, state = jax.jit(prop.block_logits)(params, state, ctx)
    for i in range(b):
        n = int(prompt_len[i])
        block = [int(tokens[i, n])] + [MASK] * 4
        want = dense_block_logits(params["net"], dc, params["embed"], params["lm_head"], feats[i, :n], block)
        np.testing.assert_allclose(np.asarray(logits[i]), want, rtol=2e-4, atol=2e-4)
    # accept 2 drafts in row 0, 0 in row 1: the path's features join the context
    path_feats = rng.normal(size=(b, 5, len(LAYERS) * CFG.hidden_size)).astype(np.float32)
    n_acc = jnp.asarray([2, 0], jnp.int32)
    result = AcceptResult(jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (b, 5)), n_acc, jnp.zeros((b,), jnp.int32))
    lengths = prompt_len + 1 + n_acc + 1
    after = SpecContext(jnp.asarray(tokens), lengths, tables, path_hidden=jnp.asarray(path_feats))
    state = jax.jit(prop.update)(params, state, after, result, jnp.ones((b,), bool))
    np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(lengths) - 1)
    logits, _ = jax.jit(prop.block_logits)(params, state, after)
    for i in range(b):
        n, a = int(prompt_len[i]), int(n_acc[i])
        context = np.concatenate([feats[i, :n], path_feats[i, : a + 1]])
        block = [int(tokens[i, n + a + 1])] + [MASK] * 4
        want = dense_block_logits(params["net"], dc, params["embed"], params["lm_head"], context, block)
        np.testing.assert_allclose(np.asarray(logits[i]), want, rtol=2e-4, atol=2e-4)


def test_dense_training_blocks_equal_the_paged_drafter(target):
    """`dflash_blocks` (training: several blocks per sequence in one dense pass, each seeing the
    context before its anchor) gives, block by block, the logits `DFlashProposer` drafts with over
    its paged cache after `init` with the context up to the anchor."""
    from specjax.proposers.dflash_net import dflash_blocks, dflash_fuse, dflash_logits

    dc, params = random_drafter(target)
    k, t = 4, 12
    prop = DFlashProposer(dc, target_layers=LAYERS, mask_token_id=MASK, block_size=k)
    rng = np.random.default_rng(1)
    feats = jnp.asarray(rng.normal(size=(2, t, len(LAYERS) * CFG.hidden_size)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, MASK, size=(2, t)).astype(np.int32))
    anchors = jnp.asarray([[2, 5, 9], [1, 7, 11]], jnp.int32)  # block 11 runs past the sequence
    blocks = jnp.full((2, 3, k), MASK, jnp.int32).at[..., 0].set(jnp.take_along_axis(tokens, anchors, axis=1))
    context = dflash_fuse(params["net"], dc, feats)
    dense = dflash_logits(
        params["lm_head"], dflash_blocks(params["net"], dc, params["embed"], context, blocks, anchors)[:, :, 1:]
    )
    tables = jnp.arange(2 * 6, dtype=jnp.int32).reshape(2, 6)
    pools = init_pages(dc, 2 * 6, 4)
    for n in range(anchors.shape[1]):
        ctx = SpecContext(tokens, anchors[:, n] + 1, tables, prompt_hidden=feats)
        state = jax.jit(prop.init)(params, pools, ctx, tokens, anchors[:, n])
        paged, _ = jax.jit(prop.block_logits)(params, state, ctx)
        np.testing.assert_allclose(np.asarray(dense[:, n]), np.asarray(paged), rtol=1e-5, atol=1e-5)


# --- greedy decoding is the target's ------------------------------------------------------------


@pytest.mark.parametrize("tree_budget", [None, 7])
def test_random_drafter_greedy_equals_vanilla(target, tree_budget):
    dc, params = random_drafter(target)
    prop = DFlashProposer(dc, target_layers=LAYERS, mask_token_id=MASK, block_size=4, tree_budget=tree_budget, top_k=3)
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 20, eos_token_ids=())
    spec = eng.generate(PROMPTS, 20, eos_token_ids=(), proposer=prop, proposer_params=params)
    assert spec.token_ids == vanilla.token_ids


def oracle(target):
    """(target', drafter config, params): target' forgets its context (its layers add nothing:
    wo = w_down = 0), so its next token is f(pending token) = argmax lm_head . norm(embed); the
    one-layer drafter's first drafted slot computes that. Its context is zero (fc = 0), every
    embedding's coordinate 0 is 1, so each head's key is the same unit vector at every slot and
    only RoPE tells slots apart; the query (from the mask token's embedding) points where the
    key one position back lands after rotation, with a large norm: slot 1 attends to slot 0
    alone. Values copy the normed input, wo amplifies it 100x over the mask's embedding in the
    residual, the MLP adds nothing: slot 1's final norm is norm(embed[pending]) to ~1%."""
    d, hd = CFG.hidden_size, CFG.head_dim
    embed = np.asarray(target["embed"]).copy()
    embed[:, 0] = 1.0
    layers = [
        {**layer, "wo": jnp.zeros_like(layer["wo"]), "w_down": jnp.zeros_like(layer["w_down"])}
        for layer in target["layers"]
    ]
    target = {**target, "embed": jnp.asarray(embed), "layers": layers}
    dc = draft_config(CFG, 1, num_kv_heads=4)
    net = init_dflash_params(jax.random.PRNGKey(7), dc, len(LAYERS), d)
    heads = dc.num_heads
    wq = np.zeros((heads * hd, d))
    wk = np.zeros((heads * hd, d))
    for h in range(heads):  # query ~ R(-1) e0 (rotate-half pairs dims 0 and hd/2), key ~ e0
        wq[h * hd, 0], wq[h * hd + hd // 2, 0] = np.cos(1.0), -np.sin(1.0)
        wk[h * hd, 0] = 1.0
    layer = {
        **net["layers"][0],
        "wq": jnp.asarray(wq),
        "wkv": jnp.asarray(np.concatenate([wk, np.eye(d)])),
        "q_norm": jnp.full((hd,), 40.0),
        "wo": 100.0 * jnp.eye(d),
        "w_down": jnp.zeros_like(net["layers"][0]["w_down"]),
    }
    net = {**net, "fc": jnp.zeros_like(net["fc"]), "layers": [layer]}
    return target, dc, {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}


@pytest.mark.parametrize("tree_budget", [None, 6])
def test_drafts_that_pass_are_accepted_and_output_stays_the_targets(target, tree_budget):
    """With the oracle drafter most steps accept a draft: fewer target passes than tokens, and
    exactly vanilla's tokens, batched over prompts of different lengths."""
    target, dc, params = oracle(target)
    prop = DFlashProposer(dc, target_layers=LAYERS, mask_token_id=MASK, block_size=4, tree_budget=tree_budget, top_k=2)
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 24, eos_token_ids=())
    spec = eng.generate(PROMPTS, 24, eos_token_ids=(), proposer=prop, proposer_params=params)
    assert spec.token_ids == vanilla.token_ids
    assert all(s <= 0.6 * 24 for s in spec.steps), spec.steps


# --- the best-first tree --------------------------------------------------------------------------


@pytest.mark.parametrize("budget,k", [(6, 3), (12, 2), (30, 3)])
def test_best_first_tree_holds_the_most_probable_prefixes(budget, k):
    """The tree's nodes are the budget - 1 most probable (depth, ranks) prefixes under the
    product of the positions' distributions (brute force), parents before children."""
    depths = 3
    rng = np.random.default_rng(budget)
    logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=depths)), axis=1)[:, ::-1][:, :k].astype(np.float32)
    ids = np.argsort(-rng.normal(size=(depths, 8)), axis=1)[:, :k].astype(np.int32)
    tok, par, dep, ok = (np.asarray(a) for a in jax.jit(best_first_tree, static_argnums=2)(logp, ids, budget))
    prefixes = [p for n in range(1, depths + 1) for p in itertools.product(range(k), repeat=n)]
    score = {p: sum(logp[i, r] for i, r in enumerate(p)) for p in prefixes}
    best = sorted(prefixes, key=lambda p: -score[p])[: budget - 1]
    got, ranks = [], {0: ()}
    for i in range(1, budget):
        if not ok[i]:
            continue
        assert par[i] < i and ok[par[i]] and dep[i] == dep[par[i]] + 1
        r = int(np.flatnonzero(ids[dep[i] - 1] == tok[i])[0])
        ranks[i] = ranks[int(par[i])] + (r,)
        got.append(ranks[i])
    assert len(got) == min(budget - 1, len(prefixes))
    assert sorted(score[p] for p in got) == pytest.approx(sorted(score[p] for p in best))
    assert all(score[a] >= score[b] - 1e-6 for a, b in zip(got, got[1:]))  # best first


# --- the public checkpoint format ----------------------------------------------------------------


def write_public_checkpoint(path, net, dc, target_layers, block_size, mask, prefix=""):
    """A drafter in the z-lab format: config.json as z-lab/Qwen3-8B-DFlash-b16's, model.safetensors
    with the reference's parameter names."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    nkv = dc.num_kv_heads * dc.head_dim
    f = dc.intermediate_size
    sd = {"fc.weight": net["fc"], "hidden_norm.weight": net["hidden_norm"], "norm.weight": net["norm"]}
    for i, layer in enumerate(net["layers"]):
        p = f"layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": layer["attn_norm"],
                p + "post_attention_layernorm.weight": layer["mlp_norm"],
                p + "self_attn.q_proj.weight": layer["wq"],
                p + "self_attn.k_proj.weight": layer["wkv"][:nkv],
                p + "self_attn.v_proj.weight": layer["wkv"][nkv:],
                p + "self_attn.o_proj.weight": layer["wo"],
                p + "self_attn.q_norm.weight": layer["q_norm"],
                p + "self_attn.k_norm.weight": layer["k_norm"],
                p + "mlp.gate_proj.weight": layer["w_gate_up"][:f],
                p + "mlp.up_proj.weight": layer["w_gate_up"][f:],
                p + "mlp.down_proj.weight": layer["w_down"],
            }
        )
    save_file(
        {prefix + k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in sd.items()},
        str(path / "model.safetensors"),
    )
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "block_size": block_size,
        "num_target_layers": CFG.num_layers,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(target_layers)},
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_hidden_layers": dc.num_layers,
        "num_attention_heads": dc.num_heads,
        "num_key_value_heads": dc.num_kv_heads,
        "head_dim": dc.head_dim,
        "rms_norm_eps": dc.rms_norm_eps,
        "rope_theta": dc.rope_theta,
        "max_position_embeddings": 40960,
        "vocab_size": CFG.vocab_size,
        "layer_types": ["full_attention"] * dc.num_layers,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("prefix", ["", "model."])
def test_converter_reads_the_public_format(target, tmp_path, prefix):
    """convert: every tensor lands where the drafter reads it (specjax heads), the config's block
    size, target layers and mask token are kept, and the converted heads and the public
    directory itself both decode through `make_proposer` exactly like vanilla."""
    from specjax.convert.dflash import is_dflash_dir
    from specjax.convert.hf import convert_checkpoint
    from specjax.methods import make_proposer
    from specjax.proposers.dflash_format import read_dflash
    from specjax.proposers.dflash_net import load_dflash_heads

    dc, params = random_drafter(target)
    net = jax.tree_util.tree_map(np.asarray, params["net"])
    src = write_public_checkpoint(tmp_path / "public", net, dc, LAYERS, 5, MASK, prefix)
    assert is_dflash_dir(src)
    config, got, meta = read_dflash(src)
    assert meta == {
        "hidden_size": 32,
        "vocab_size": 64,
        "target_layers": list(LAYERS),
        "block_size": 5,
        "mask_token_id": MASK,
    }
    assert config.num_layers == 2 and config.qk_norm and config.head_dim == dc.head_dim
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, net)
    out = convert_checkpoint(src, tmp_path / "sj")
    cfg2, loaded, meta2 = load_dflash_heads(out)
    assert cfg2 == config and meta2["target_layers"] == list(LAYERS) and meta2["block_size"] == 5
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, net)
    model = Model(target, CFG, tmp_path, CFG.to_hf())
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS[:2], 12, eos_token_ids=())
    for heads in (out, src):
        prop, pp = make_proposer("dflash", model, heads=str(heads))
        assert (prop.block_size, prop.feature_layers, prop.mask_token_id, prop.rule) == (5, LAYERS, MASK, "residual")
        spec = eng.generate(PROMPTS[:2], 12, eos_token_ids=(), proposer=prop, proposer_params=pp)
        assert spec.token_ids == vanilla.token_ids


def test_converter_refuses_what_it_cannot_read(target, tmp_path):
    from specjax.checkpoint import CheckpointError
    from specjax.proposers.dflash_format import read_dflash

    dc, params = random_drafter(target)
    net = jax.tree_util.tree_map(np.asarray, params["net"])
    src = write_public_checkpoint(tmp_path / "a", net, dc, LAYERS, 4, MASK)
    raw = json.loads((src / "config.json").read_text())
    for change, words in (
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
        ({"dflash_config": {"target_layer_ids": list(LAYERS)}}, "mask_token_id"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 1, 2]}}, "fc.weight"),
    ):
        (src / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(CheckpointError, match=words):
            read_dflash(src)
    (src / "config.json").write_text(json.dumps(raw))
    bad = write_public_checkpoint(
        tmp_path / "b", {**net, "layers": net["layers"][:1]}, dataclasses.replace(dc, num_layers=1), LAYERS, 4, MASK
    )
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match="layers.1.input_layernorm.weight"):
        read_dflash(bad)


def test_default_target_layers_follow_the_reference():
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab/Qwen3-8B-DFlash-b16's ids
    assert default_target_layers(36, 1) == (18,)
    assert default_target_layers(3, 2) == (1, 0)  # clipped into a tiny target


# --- the method -----------------------------------------------------------------------------------


def test_method_options_and_random_heads(target, tmp_path):
    from specjax.method_configs import MethodError
    from specjax.methods import make_proposer
    from specjax.random_heads import random_head_checkpoint

    model = Model(target, CFG, tmp_path, CFG.to_hf())
    heads = str(random_head_checkpoint("dflash", model, tmp_path / "dflash"))
    prop, _ = make_proposer("dflash", model, heads=heads)
    assert prop.is_chain and prop.tree_size == 4 and prop.rule == "residual"
    prop, _ = make_proposer("dflash", model, heads=heads, dflash_block_size=6, dflash_tree_budget=10, dflash_top_k=2)
    assert not prop.is_chain and prop.tree_size == 10 and prop.max_path_len == 6 and prop.rule == "match"
    assert prop.draft_scratch == 6
    prop, _ = make_proposer("dflash", model, heads=heads, dflash_acceptance="match")
    assert prop.is_chain and prop.rule == "match"
    with pytest.raises(MethodError, match="residual"):
        make_proposer("dflash", model, heads=heads, dflash_tree_budget=8, dflash_acceptance="residual")
    with pytest.raises(MethodError, match="needs --heads"):
        make_proposer("dflash", model)
    with pytest.raises(MethodError, match=">= 2"):
        make_proposer("dflash", model, heads=heads, dflash_block_size=1)
    with pytest.raises(MethodError, match="residual"):  # a graft needs a rule over trees
        make_proposer("dflash", model, heads=heads, lookup_tokens=3)
    # prompt lookup grafted onto a `match` chain and onto a tree: still the target's output
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 16, eos_token_ids=())
    for extra in ({"dflash_acceptance": "match"}, {"dflash_tree_budget": 6}):
        prop, pp = make_proposer("dflash", model, heads=heads, lookup_tokens=3, **extra)
        assert type(prop).__name__ == "LookupGraftProposer"
        assert eng.generate(PROMPTS, 16, eos_token_ids=(), proposer=prop, proposer_params=pp).token_ids == (
            vanilla.token_ids
        )
