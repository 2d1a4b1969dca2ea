"""ReDrafter: beam search, beams merged into a prefix tree, lossless decoding, and the converter of
apple/ml-recurrent-drafter checkpoints checked against a PyTorch forward of the same drafter."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax import Engine
from specjax.checkpoint import CheckpointError
from specjax.cli import main
from specjax.cpu.matmul import unpack_params
from specjax.loading import load_model
from specjax.model import lm_head_weight
from specjax.proposers import redrafter as rd
from specjax.sampling import SamplingConfig

PROMPTS = [[5, 17, 99, 230, 41, 8, 77, 12, 3, 150, 64], [200, 31]]


# ----------------------------------------------------------------------------- beams -> tree


def _check_tree(tree, beams):
    """Structural invariants of a merged tree, and that it holds exactly the beams' prefixes."""
    tokens, parent, depth, valid = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.depth, tree.valid))
    beams = np.asarray(beams)
    for b in range(tokens.shape[0]):
        assert parent[b, 0] == -1 and depth[b, 0] == 0 and valid[b, 0]
        paths = {0: ()}
        for i in range(1, tokens.shape[1]):
            p = parent[b, i]
            assert 0 <= p < i
            assert depth[b, i] == depth[b, p] + 1
            if valid[b, i]:
                assert valid[b, p]
                paths[i] = paths[p] + (int(tokens[b, i]),)
        got = [paths[i] for i in paths if i]
        assert len(got) == len(set(got)), "duplicate valid nodes (or siblings)"
        want = {tuple(int(t) for t in beam[: d + 1]) for beam in beams[b] for d in range(len(beam))}
        assert set(got) == want


def test_hand_made_beams_merge_into_the_expected_tree():
    beams = jnp.asarray([[[1, 2, 3], [1, 2, 4], [5, 2, 3]], [[7, 7, 7], [7, 7, 7], [7, 8, 7]]], jnp.int32)
    tree = rd.beams_to_tree(jnp.asarray([9, 6]), beams)
    assert tree.tokens[:, 0].tolist() == [9, 6]
    # Row 0: beam 1 shares [1, 2] with beam 0, so only its last token (4) is new; beam 2 is new.
    assert tree.parent[0].tolist() == [-1, 0, 1, 2, 0, 1, 2, 0, 7, 8]
    assert tree.valid[0].tolist() == [True, True, True, True, False, False, True, True, True, True]
    assert tree.depth[0].tolist() == [0, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    # Row 1: beam 1 repeats beam 0 entirely; beam 2 branches after its first token.
    assert tree.valid[1].tolist() == [True, True, True, True, False, False, False, False, True, True]
    assert tree.parent[1].tolist() == [-1, 0, 1, 2, 0, 1, 2, 0, 1, 8]
    _check_tree(tree, beams)


def test_random_beams_make_valid_trees():
    beams = jax.random.randint(jax.random.PRNGKey(0), (32, 4, 4), 0, 3)
    tree = jax.jit(rd.beams_to_tree)(jnp.zeros((32,), jnp.int32), beams)
    _check_tree(tree, beams)
    assert not bool(jnp.all(tree.valid))  # 3 tokens, 4 beams: prefixes do repeat
    # Compacted: the valid nodes come first, and the tree still holds exactly the prefixes.
    packed = jax.jit(rd.compact_tree)(tree)
    _check_tree(packed, beams)
    n = np.asarray(packed.valid).sum(axis=1)
    assert (np.asarray(packed.valid) == (np.arange(17)[None, :] < n[:, None])).all()
    assert (n == np.asarray(tree.valid).sum(axis=1)).all()


# ----------------------------------------------------------------------------- beam search

D, V = 16, 40
_beam_search = jax.jit(rd.beam_search, static_argnames=("num_beams", "draft_len", "rnn", "warp_top_k", "temperature"))


@pytest.fixture(scope="module")
def small_drafter():
    params = rd.init_params(jax.random.PRNGKey(3), D, V, num_draft_layers=2, rnn=True, scale=3.0)
    embed = jax.random.normal(jax.random.PRNGKey(4), (V, D))
    hidden = jax.random.normal(jax.random.PRNGKey(5), (3, D))
    return params, embed, hidden, jnp.asarray([1, 2, 3])


def test_single_beam_is_the_greedy_chain(small_drafter):
    params, embed, hidden, init = small_drafter
    beams, score = rd.beam_search(params, embed, hidden, init, num_beams=1, draft_len=4, rnn=True)
    state, last, total = jnp.zeros_like(hidden), init, 0.0
    for d in range(4):
        state = rd.rnn_step(params, state, embed[last], True)
        logp = jax.nn.log_softmax(rd.warp_logits(rd.drafter_logits(params, hidden, state), 50))
        last = jnp.argmax(logp, -1)
        total = total + jnp.max(logp, -1)
        assert beams[:, 0, d].tolist() == last.tolist()
    np.testing.assert_allclose(score[:, 0], total, rtol=1e-5)


def test_sampled_beams(small_drafter):
    params, embed, hidden, init = small_drafter
    kw = dict(num_beams=4, draft_len=3, rnn=True)
    greedy, _ = _beam_search(params, embed, hidden, init, **kw)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(3))
    cold, _ = _beam_search(params, embed, hidden, init, temperature=1e-3, keys=keys, **kw)
    top, _ = _beam_search(params, embed, hidden, init, temperature=1e-3, **kw)
    assert cold.tolist() == top.tolist()  # the noise is negligible at a tiny temperature
    draws = [
        _beam_search(
            params,
            embed,
            hidden,
            init,
            temperature=1.0,
            keys=jax.vmap(jax.random.PRNGKey)(jnp.arange(3) + 10 * s),
            **kw,
        )[0]
        for s in range(4)
    ]
    assert any(d.tolist() != greedy.tolist() for d in draws)
    for d in draws:  # sampling without replacement: each sequence's beams stay distinct
        for row in np.asarray(d).tolist():
            assert len({tuple(beam) for beam in row}) == len(row)


# ----------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    """The tiny Llama, and random ReDrafter heads for it saved as a specjax head checkpoint."""
    d, _ = tiny_llama
    model = load_model(str(d), dtype=jnp.float32)
    cfg = model.config
    shapes = rd.ReDrafterProposer(cfg.hidden_size, cfg.vocab_size, num_draft_layers=2, rnn=True)
    params = shapes.init_params(jax.random.PRNGKey(7), scale=3.0)
    heads = rd.save_redrafter(tmp_path_factory.mktemp("rd") / "heads", params, rd.head_meta(shapes))
    eng = Engine(model.params, cfg, num_pages=256, page_size=8)
    return model, heads, eng


def test_greedy_equals_vanilla(tiny):
    model, heads, eng = tiny
    proposer, pparams = rd.make_redrafter(model, heads)
    assert (proposer.num_beams, proposer.draft_len_per_beam, proposer.tree_size) == (5, 5, 26)
    for prompts in (PROMPTS[:1], PROMPTS):
        vanilla = eng.generate(prompts, 16, eos_token_ids=())
        spec = eng.generate(prompts, 16, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
        assert spec.token_ids == vanilla.token_ids
        assert all(s <= 16 for s in spec.steps)


def test_single_beam_decodes_as_a_chain(tiny):
    """One beam drafts a chain: commit keeps its K/V in place (is_chain), output equals vanilla."""
    model, heads, eng = tiny
    proposer, pparams = rd.make_redrafter(model, heads, num_beams=1, draft_len_per_beam=3)
    assert proposer.is_chain and not rd.make_redrafter(model, heads)[0].is_chain
    vanilla = eng.generate(PROMPTS, 16, eos_token_ids=())
    spec = eng.generate(PROMPTS, 16, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids


def test_reduced_draft_vocabulary(tiny, tmp_path):
    """Heads over a reduced draft vocabulary (draft_ids): beams hold only those target ids, the
    checkpoint round-trips, and output equals vanilla."""
    model, _, eng = tiny
    cfg = model.config
    shapes = rd.ReDrafterProposer(cfg.hidden_size, cfg.vocab_size, rnn=True)
    params = shapes.init_params(jax.random.PRNGKey(3), scale=3.0)
    ids = jax.random.permutation(jax.random.PRNGKey(4), cfg.vocab_size)[:40].astype(jnp.int32)
    params["lm_head"] = params["lm_head"][ids]
    params["draft_ids"] = ids
    heads = rd.save_redrafter(tmp_path / "rd40", params, {**rd.head_meta(shapes), "draft_vocab_size": 40})
    proposer, pparams = rd.make_redrafter(model, heads, num_beams=3, draft_len_per_beam=3)
    assert pparams["drafter"]["draft_ids"].dtype == jnp.int32
    h = jax.random.normal(jax.random.PRNGKey(5), (2, cfg.hidden_size))
    beams, _ = rd.beam_search(
        pparams["drafter"], pparams["embed"], h, jnp.asarray([3, 4]), num_beams=3, draft_len=3, rnn=True
    )
    assert set(np.asarray(beams).ravel().tolist()) <= set(np.asarray(ids).tolist())
    vanilla = eng.generate(PROMPTS, 12, eos_token_ids=())
    spec = eng.generate(PROMPTS, 12, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids


def test_sampled_beams_decode_losslessly(tiny):
    """greedy_search=False: beams are sampled at the request's temperature. With top_k=1 the
    target's distribution is one-hot, so the output must equal greedy decoding; with real
    sampling a seed reproduces its output."""
    model, heads, eng = tiny
    proposer, pparams = rd.make_redrafter(model, heads, num_beams=3, draft_len_per_beam=3, greedy_search=False)
    vanilla = eng.generate(PROMPTS, 16, eos_token_ids=())
    kw = dict(eos_token_ids=(), proposer=proposer, proposer_params=pparams, fixed_speculation=True)
    spec = eng.generate(PROMPTS, 16, sampling=SamplingConfig(temperature=0.8, top_k=1), seeds=[4, 5], **kw)
    assert spec.token_ids == vanilla.token_ids
    hot = SamplingConfig(temperature=1.5)
    a = eng.generate(PROMPTS, 16, sampling=hot, seeds=[1, 2], **kw)
    b = eng.generate(PROMPTS, 16, sampling=hot, seeds=[1, 2], **kw)
    assert a.token_ids == b.token_ids and all(len(t) == 16 for t in a.token_ids)
    assert a.token_ids != vanilla.token_ids


def test_oracle_drafter_accepts_whole_beams(tiny):
    """A drafter whose head is the target's own LM head over h (ResBlocks the identity, the RNN
    half zeroed) drafts the target's next token at every depth; a model stuck repeating one
    token accepts whole beams, with 5 beams and with one (a chain)."""
    model, _, _ = tiny
    cfg = model.config
    loop = unpack_params(model.params)  # every token but 7 embeds alike (tied: the LM head too)
    loop["embed"] = jnp.zeros_like(loop["embed"]).at[:, 0].set(1.0).at[7, 0].set(5.0)
    eng = Engine(loop, cfg, num_pages=256, page_size=8)
    vanilla = eng.generate(PROMPTS[:1], 16, eos_token_ids=())
    assert len(set(vanilla.token_ids[0])) == 1
    proposer = rd.ReDrafterProposer(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_draft_layers=2)
    drafter = proposer.init_params(jax.random.PRNGKey(1))
    drafter["resblocks"] = jax.tree_util.tree_map(jnp.zeros_like, drafter["resblocks"])
    drafter["lm_head"] = jnp.concatenate([lm_head_weight(loop), jnp.zeros((cfg.vocab_size, cfg.hidden_size))], axis=1)
    one_beam = dataclasses.replace(proposer, num_beams=1, draft_len_per_beam=3)  # a chain
    for prop, per_step in ((proposer, 6), (one_beam, 4)):  # root + all drafts accepted
        spec = eng.generate(
            PROMPTS[:1],
            16,
            eos_token_ids=(),
            proposer=prop,
            proposer_params={"drafter": drafter, "embed": loop["embed"]},
        )
        assert spec.token_ids == vanilla.token_ids
        assert spec.steps[0] == math.ceil(16 / per_step)


# ----------------------------------------------------------------------------- converter


class TorchResBlock(torch.nn.Module):  # apple/ml-recurrent-drafter's module layout
    def __init__(self, e):
        super().__init__()
        self.linear = torch.nn.Linear(e, e, bias=True)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.linear(x))


class TorchDrafter(torch.nn.Module):
    """The reference drafter's parameters (same names) and forward, written out for the test."""

    def __init__(self, d, v, exit_dim, layers, rnn):
        super().__init__()
        self.rnn = rnn
        if exit_dim != 2 * d:
            self.input_proj = torch.nn.Linear(2 * d, exit_dim, bias=True)
        self.lm_head = torch.nn.Sequential(
            *[TorchResBlock(exit_dim) for _ in range(layers)], torch.nn.Linear(exit_dim, v, bias=False)
        )
        if rnn:
            self.rnn_u = torch.nn.Linear(d, d, bias=True)
            self.rnn_w = torch.nn.Linear(d, d, bias=False)

    def logits(self, h, s):
        x = torch.cat([h, s], -1)
        return self.lm_head(self.input_proj(x) if hasattr(self, "input_proj") else x)

    def step(self, s, e):
        return torch.nn.functional.silu(self.rnn_w(e) + self.rnn_u(s)) if self.rnn else e + s

    def beam_search(self, h, init, embed, w, length):
        """Beam search as the reference runs it: max-shifted logits, top-50 warp, top-k."""
        b, d = h.shape
        v = embed.shape[0]
        score = torch.tensor([0.0] + [-50000.0] * (w - 1)).repeat(b, 1)
        ctx = h[:, None].repeat(1, w, 1)
        beams = init[:, None, None].repeat(1, w, 1)
        s = torch.zeros(b, w, d)
        rows = torch.arange(b)[:, None]
        for _ in range(length):
            s = self.step(s, embed[beams[..., -1]])
            z = self.logits(ctx, s)
            z = z - z.max(-1, keepdim=True)[0]
            z = z.masked_fill(z < torch.topk(z, min(50, v))[0][..., -1:], -50000.0)
            total = (z.log_softmax(-1) + score[..., None]).reshape(b, w * v)
            score, idx = torch.topk(total, w)
            src, tok = idx // v, idx % v
            beams = torch.cat([beams[rows, src], tok[..., None]], -1)
            s = s[rows, src]
        return beams[..., 1:]


def write_apple_drafter(path, d, v, *, exit_dim=None, layers=2, rnn=True, fmt="safetensors", seed=0):
    torch.manual_seed(seed)
    e = 2 * d if exit_dim is None else exit_dim
    net = TorchDrafter(d, v, e, layers, rnn).eval()
    with torch.no_grad():  # larger weights than the default init, so the drafts vary
        for p in net.parameters():
            p.mul_(3.0)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: t.contiguous() for k, t in net.state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "recurrent_drafting_drafter",
                "architectures": ["Drafter"],
                "vocab_size": v,
                "hidden_size": d,
                "exit_dim": e,
                "num_draft_layers": layers,
                "num_lookback_tokens": -1,
                "rnn": rnn,
                "torch_dtype": "float32",
            }
        )
    )
    return net


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("variant", ["rnn", "proj-sum-bin"])
def test_converted_drafter_matches_pytorch(tiny_llama, tiny, tmp_path, variant):
    _, hf = tiny_llama
    cfg = hf.config
    d, v = cfg.hidden_size, cfg.vocab_size
    kw = dict(rnn=True, layers=2) if variant == "rnn" else dict(rnn=False, layers=1, exit_dim=48, fmt="bin")
    net = write_apple_drafter(tmp_path / "apple", d, v, **kw)
    assert main(["convert", str(tmp_path / "apple"), "--out", str(tmp_path / "sj")]) == 0
    meta, params = rd.load_redrafter(tmp_path / "sj")
    assert meta["rnn"] == kw["rnn"] and meta["exit_dim"] == kw.get("exit_dim", 2 * d)
    embed = hf.model.embed_tokens.weight.detach()
    h = torch.randn(3, d)
    s = torch.zeros(3, d)
    tokens = torch.tensor([[4, 9, 120], [7, 7, 300], [0, 1, 2]])
    sj_s = jnp.zeros((3, d))
    for t in range(3):  # a few recurrent steps: states and logits agree
        with torch.no_grad():
            s = net.step(s, embed[tokens[:, t]])
            want = net.logits(h, s).numpy()
        sj_s = rd.rnn_step(params, sj_s, jnp.asarray(embed[tokens[:, t]].numpy()), meta["rnn"])
        got = np.asarray(rd.drafter_logits(params, jnp.asarray(h.numpy()), sj_s))
        assert _rel(got, want) < 1e-4
    # The whole beam search picks the same beams as the reference's.
    init = torch.tensor([5, 17, 250])
    with torch.no_grad():
        want = net.beam_search(h, init, embed, 4, 3).numpy()
    got, _ = rd.beam_search(
        params,
        jnp.asarray(embed.numpy()),
        jnp.asarray(h.numpy()),
        jnp.asarray(init.numpy()),
        num_beams=4,
        draft_len=3,
        rnn=meta["rnn"],
    )
    assert np.asarray(got).tolist() == want.tolist()
    if variant == "rnn":  # the converted heads decode through make_redrafter like vanilla
        model, _, eng = tiny  # (same shapes as test_greedy_equals_vanilla: no new compiles)
        proposer, pparams = rd.make_redrafter(model, tmp_path / "sj")
        vanilla = eng.generate(PROMPTS[:1], 16, eos_token_ids=())
        spec = eng.generate(PROMPTS[:1], 16, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
        assert spec.token_ids == vanilla.token_ids


def _one_line_error(excinfo, *words):
    msg = str(excinfo.value)
    assert len(msg.splitlines()) == 1, msg
    for w in words:
        assert w in msg, msg


def test_converter_and_loader_errors(tiny_llama, tmp_path, capsys):
    d_dir, hf = tiny_llama
    model = load_model(str(d_dir), dtype=jnp.float32)
    # Heads for another hidden size convert, then are refused by the model.
    write_apple_drafter(tmp_path / "h48", 48, model.config.vocab_size, layers=1)
    assert main(["convert", str(tmp_path / "h48"), "--out", str(tmp_path / "sj48")]) == 0
    with pytest.raises(CheckpointError) as e:
        rd.make_redrafter(model, tmp_path / "sj48")
    _one_line_error(e, "hidden_size 48", "model has 64")
    # A drafter directory without weights.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "recurrent_drafting_drafter",
                "vocab_size": 320,
                "hidden_size": 64,
                "exit_dim": 128,
                "num_draft_layers": 1,
                "rnn": True,
            }
        )
    )
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no ReDrafter weights" in err, err
    # Config and tensors that disagree.
    write_apple_drafter(tmp_path / "bad", 64, 320, layers=2, rnn=True)
    cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "num_draft_layers": 1}))
    with pytest.raises(CheckpointError) as e:
        from specjax.convert.redrafter import read_redrafter

        read_redrafter(tmp_path / "bad")
    _one_line_error(e, "lacks tensor 'lm_head.1.weight'")
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32, "exit_dim": 64}))
    with pytest.raises(CheckpointError) as e:
        read_redrafter(tmp_path / "bad")
    _one_line_error(e, "shape")
    # A model directory or a missing path is not a head checkpoint.
    with pytest.raises(CheckpointError) as e:
        rd.make_redrafter(model, tmp_path / "nowhere")
    _one_line_error(e, "not a specjax head checkpoint")
    with pytest.raises(ValueError) as e:
        rd.make_redrafter(model, None)
    _one_line_error(e, "--heads")
    with pytest.raises(ValueError) as e:
        rd.ReDrafterProposer(hidden_size=64, vocab_size=320, num_beams=0)
    _one_line_error(e, "num_beams")


def test_cli_redrafter_equals_vanilla(tiny_llama, tmp_path, capsys):
    """`specjax generate --method redrafter --heads` (converted Apple drafter) == vanilla."""
    d_dir, hf = tiny_llama
    write_apple_drafter(tmp_path / "apple", hf.config.hidden_size, hf.config.vocab_size, rnn=True, layers=1)
    assert main(["convert", str(tmp_path / "apple"), "--out", str(tmp_path / "sj")]) == 0
    base = [
        "generate",
        "--model",
        str(d_dir),
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
            "redrafter",
            "--heads",
            str(tmp_path / "sj"),
            "--redrafter-num-beams",
            "3",
            "--redrafter-draft-len-per-beam",
            "3",
        ],
    ):
        assert main(base + extra) == 0
        outs.append([json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()])
    assert outs[0] == outs[1]
    assert main(base + ["--method", "redrafter"]) == 1
    assert "needs --heads" in capsys.readouterr().err
