"""Training module: data, features, losses against torch, resumable training, heads that decode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags

from specjax.training.data import DataError, read_prompt_file
from specjax.training.losses import eagle3_loss, eagle_loss, medusa_loss, redrafter_loss, uniform_feature_noise
from specjax.training.train import TrainConfig, batch_ids, run

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("math", "code", "chat")
STEPS = 24


def write_prompts(path: Path, n: int = 16) -> Path:
    rows = [
        {
            "id": f"p{i}",
            "category": CATEGORIES[i % 3],
            "turns": [f"Question {i}: what is {i} + {2 * i}? Say hello to the fox."],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """Tiny base, prompt file, and a data folder (distillation + features) shared by methods."""
    root = tmp_path_factory.mktemp("training")
    prompts = write_prompts(root / "prompts.jsonl")
    base = str(tiny_llama[0])
    res = run(config("medusa", base, prompts, root / "prep", root / "data", until="features"), progress=False)
    assert res["sequences"] == 10
    return {"root": root, "base": base, "prompts": prompts, "data": root / "data"}


def config(method, base, prompts, out, data, **kw):
    opts = dict(
        max_prompts=10,
        max_new_tokens=16,
        distill_batch=4,
        feature_batch=4,
        steps=STEPS,
        batch_size=4,
        max_len=64,
        lr=3e-3,
        warmup=4,
        save_every=8,
        eval_prompts=3,
        eval_max_new_tokens=10,
    )
    opts.update(kw)
    return TrainConfig(method=method, base=str(base), prompts=str(prompts), out=str(out), data=str(data), **opts)


# ------------------------------------------------------------------------------------------
# Prompt files


def test_prompt_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty"):
        read_prompt_file(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n{"prompt": "c"\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        read_prompt_file(bad)
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"turns": ["a"]}\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"odd.jsonl:2: .*'turns', 'prompt' or 'text'"):
        read_prompt_file(odd)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"turns": ["a", "b"], "category": "x"}\n{"prompt": "c"}\n{"text": "d"}\n')
    recs = read_prompt_file(ok)
    assert [(r.text, r.category, r.is_text) for r in recs] == [
        ("a", "x", False),
        ("c", "default", False),
        ("d", "default", True),
    ]


def test_cli_bad_prompt_files(tiny_llama, tmp_path, capsys):
    from specjax.cli import main

    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "m.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n[1, 2\n')
    for name, words in (("e.jsonl", "empty"), ("m.jsonl", "m.jsonl:3:")):
        rc = main(
            [
                "train",
                "--method",
                "medusa",
                "--base",
                str(tiny_llama[0]),
                "--prompts",
                str(tmp_path / name),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        err = capsys.readouterr().err.strip()
        assert rc == 1 and words in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "option",
    [
        ["--draft-steps", "0"],
        ["--num-heads", "0"],
        ["--loss-positions", "-1"],
        ["--noise-std", "-0.1"],
        ["--token-loss-weight", "-1"],
        ["--feature-loss-weight", "nan"],
        # options EAGLE does not have: refused, not ignored
        ["--num-heads", "3"],
        ["--draft-vocab-size", "64"],
        ["--block-size", "1"],
        ["--loss-decay-gamma", "0"],
        ["--block-size", "8"],  # DFlash's
    ],
)
def test_cli_bad_method_options(tiny_llama, tmp_path, capsys, option):
    from specjax.cli import main

    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    rc = main(
        [
            "train",
            "--method",
            "eagle",
            "--base",
            str(tiny_llama[0]),
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--out",
            str(tmp_path / "o"),
            *option,
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 1 and option[0] in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_cli_loss_weights_reach_the_eagle_loss(tmp_path, capsys):
    import argparse

    from specjax.cli import main
    from specjax.training.command import add_train_parser, config_from_args
    from specjax.training.trainers import make_method

    parser = add_train_parser(argparse.ArgumentParser().add_subparsers())
    base = ["--method", "eagle", "--prompts", "p.jsonl", "--out", "o"]
    cfg = config_from_args(parser.parse_args(base + ["--token-loss-weight", "0.5", "--feature-loss-weight", "0.25"]))
    method = make_method("eagle", **dict(cfg.method_options))
    assert (method.p_w, method.v_w) == (0.5, 0.25)
    default = make_method("eagle", **dict(config_from_args(parser.parse_args(base)).method_options))
    assert (default.p_w, default.v_w, default.token_loss) == (0.1, 1.0, "kl")
    lk = config_from_args(parser.parse_args(base + ["--token-loss", "lk"]))
    assert make_method("eagle", **dict(lk.method_options)).token_loss == "lk"
    # both terms off, or a weight on a method without it: one-line errors, nothing written
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    for method_name, extra, words in (
        ("eagle", ["--token-loss-weight", "0", "--feature-loss-weight", "0"], "both 0"),
        ("medusa", ["--token-loss-weight", "1"], "--token-loss-weight does not apply"),
        ("eagle3", ["--token-loss", "lk"], "--token-loss does not apply"),
    ):
        rc = main(
            [
                "train",
                "--method",
                method_name,
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--out",
                str(tmp_path / "o"),
                *extra,
            ]
        )
        err = capsys.readouterr().err.strip()
        assert rc == 1 and words in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "o").exists()


def test_make_method_refuses_options_it_lacks():
    from specjax.training.trainers import make_method

    with pytest.raises(ValueError, match="no option draft_steps"):
        make_method("eagle", draft_steps=3)  # EAGLE's option is `steps`
    assert make_method("eagle", steps=3, num_heads=None).steps == 3  # None: not set


# ------------------------------------------------------------------------------------------
# Losses against a direct torch computation


def test_medusa_loss_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    b, t, k, v = 2, 12, 3, 11
    logits = rng.normal(size=(b, t, k, v)).astype(np.float32) * 2
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = rng.random((b, t)) > 0.3
    loss, m = medusa_loss(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    want_total = 0.0
    for j in range(k):  # head j at position i predicts tokens[i + j + 2], answer tokens only
        lg = torch.tensor(logits[:, : t - j - 2, j]).reshape(-1, v)
        lab = torch.tensor(tokens[:, j + 2 :]).reshape(-1).long()
        keep = torch.tensor(mask[:, j + 2 :]).reshape(-1)
        lab = torch.where(keep, lab, torch.full_like(lab, -100))
        ce = torch.nn.functional.cross_entropy(lg, lab, ignore_index=-100).item()
        acc = (lg.argmax(-1) == lab)[keep].float().mean().item()
        np.testing.assert_allclose(float(m["loss_k"][j]), ce, rtol=1e-5)
        np.testing.assert_allclose(float(m["acc_k"][j]), acc, rtol=1e-6)
        want_total += 0.8 ** (j + 1) * ce
    np.testing.assert_allclose(float(loss), want_total, rtol=1e-5)


def test_eagle_loss_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    b, t, d, v = 2, 9, 6, 13
    pred = rng.normal(size=(b, t, d)).astype(np.float32) * 1.5
    target = rng.normal(size=(b, t, d)).astype(np.float32)
    head = rng.normal(size=(v, d)).astype(np.float32)
    mask = rng.random((b, t)) > 0.4
    loss, m = eagle_loss(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(head), jnp.asarray(mask))
    P, T, H = torch.tensor(pred), torch.tensor(target), torch.tensor(head)
    M = torch.tensor(mask, dtype=torch.float32)[:, :, None]
    target_p = torch.softmax(T @ H.T, -1)
    logp = torch.log_softmax(P @ H.T, -1)
    ploss = -torch.sum(torch.sum(M * target_p * logp, 2)) / (M.sum() + 1e-5)
    vl = torch.nn.SmoothL1Loss(reduction="none")(P, T)
    vloss = torch.sum(torch.mean(M * vl, 2)) / (M.sum() + 1e-5)
    np.testing.assert_allclose(float(m["ploss"]), ploss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(m["vloss"]), vloss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), vloss.item() + 0.1 * ploss.item(), rtol=1e-5)
    weighted, _ = eagle_loss(
        jnp.asarray(pred), jnp.asarray(target), jnp.asarray(head), jnp.asarray(mask), v_w=0.3, p_w=2.0
    )
    np.testing.assert_allclose(float(weighted), 0.3 * vloss.item() + 2.0 * ploss.item(), rtol=1e-5)
    agree = ((P @ H.T).argmax(-1) == (T @ H.T).argmax(-1)).float()
    np.testing.assert_allclose(
        float(m["acc_k"][0]), (agree * M[..., 0]).sum().item() / (M.sum().item() + 1e-5), rtol=1e-6
    )
    # Scored positions: token terms at those positions only, the regression still everywhere.
    pos = np.array([[1, 4, 7], [0, 2, 8]], np.int32)
    ok = np.array([[True, True, False], [True, True, True]])
    _, ms = eagle_loss(
        jnp.asarray(pred),
        jnp.asarray(target),
        jnp.asarray(head),
        jnp.asarray(mask),
        positions=jnp.asarray(pos),
        ok=jnp.asarray(ok),
    )
    sel = np.zeros((b, t), np.float32)
    for r in range(b):
        sel[r, pos[r][ok[r]]] = 1
    Ms = M * torch.tensor(sel)[:, :, None]
    want_p = -torch.sum(torch.sum(Ms * target_p * logp, 2)) / (Ms.sum() + 1e-5)
    np.testing.assert_allclose(float(ms["ploss"]), want_p.item(), rtol=1e-5)
    np.testing.assert_allclose(float(ms["vloss"]), vloss.item(), rtol=1e-5)


def test_eagle_lk_loss_is_minus_log_acceptance():
    """token_loss="lk": ploss = -log sum_v min(p_v, q_v) (alpha = 1 - TV), averaged over the
    mask; at a one-hot p it is the cross-entropy; trained under a capacity limit it reaches a
    higher alpha than the KL term does (the LK paper's point)."""
    rng = np.random.default_rng(2)
    b, t, d, v = 2, 7, 5, 11
    pred = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    mask = jnp.asarray(rng.random((b, t)) > 0.3)
    p = np.asarray(jax.nn.softmax(target @ head.T, -1), np.float64)
    q = np.asarray(jax.nn.softmax(pred @ head.T, -1), np.float64)
    alpha = np.minimum(p, q).sum(-1)
    m = np.asarray(mask, np.float64)
    loss, metrics = eagle_loss(pred, target, head, mask, v_w=0.5, p_w=2.0, token_loss="lk")
    want = -(m * np.log(alpha)).sum() / (m.sum() + 1e-5)
    np.testing.assert_allclose(float(metrics["ploss"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["alpha"]), (m * alpha).sum() / (m.sum() + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.5 * float(metrics["vloss"]) + 2.0 * want, rtol=1e-5)
    kl_metrics = eagle_loss(pred, target, head, mask)[1]  # same alpha and KL under either term
    np.testing.assert_allclose(float(kl_metrics["alpha"]), float(metrics["alpha"]), rtol=1e-6)
    np.testing.assert_allclose(float(kl_metrics["kl"]), float(metrics["kl"]), rtol=1e-6)
    sharp = 1e3 * target  # p one-hot: -log q(argmax p), the cross-entropy
    np.testing.assert_allclose(
        float(eagle_loss(pred, sharp, head, mask, token_loss="lk")[1]["ploss"]),
        float(eagle_loss(pred, sharp, head, mask)[1]["ploss"]),
        rtol=1e-4,
    )
    with pytest.raises(ValueError, match="unknown token loss 'tv'"):
        eagle_loss(pred, target, head, mask, token_loss="tv")

    # A draft of one parameter s (q = softmax(s * base)) fitted to a p it cannot match: head
    # rows (base_v, log p_v), target feature (0, 1), predicted (s, 0). The LK term ends with
    # the higher acceptance rate.
    p1 = np.array([0.55, 0.25, 0.2, 1e-6, 1e-6, 1e-6, 1e-6, 1e-6])
    base = np.array([3.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    head1 = jnp.asarray(np.stack([base, np.log(p1)], 1), jnp.float32)
    target1, mask1 = jnp.asarray([[[0.0, 1.0]]]), jnp.ones((1, 1), bool)

    def fitted(kind):
        def loss_of(s):
            pred1 = jnp.stack([s, 0.0])[None, None]
            return eagle_loss(pred1, target1, head1, mask1, v_w=0.0, p_w=1.0, token_loss=kind)[0]

        s = jnp.asarray(0.1)
        for _ in range(300):
            s = s - 0.1 * jax.grad(loss_of)(s)
        return float(eagle_loss(jnp.stack([s, 0.0])[None, None], target1, head1, mask1)[1]["alpha"])

    assert fitted("lk") > fitted("kl") + 0.05, (fitted("lk"), fitted("kl"))


def test_eagle_draft_vocab_loss():
    """EAGLE's loss over a draft vocabulary is eagle_loss with the head's rows of it."""
    from specjax import ModelConfig, init_params
    from specjax.training.losses import eagle_shift
    from specjax.training.trainers import lm_head_weight, make_method

    cfg = ModelConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        max_position_embeddings=64,
    )
    base = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    rng = np.random.default_rng(9)
    b, t = 2, 10
    batch = {
        "tokens": jnp.asarray(rng.integers(0, 40, (b, t)), jnp.int32),
        "final": jnp.asarray(rng.normal(size=(b, t, 16)), jnp.float32),
        "mask": jnp.asarray(rng.random((b, t)) > 0.3),
        "valid": jnp.ones((b, t), bool),
    }
    rows = jnp.asarray(rng.permutation(40)[:12].astype(np.int32))
    frozen = {"base": base, "draft_ids": rows}
    method = make_method("eagle", draft_vocab_loss=True, noise_std=0.0)
    params = method.init_params(jax.random.PRNGKey(1), frozen, cfg)
    got, gm = method.loss(params, frozen, cfg, batch, jax.random.PRNGKey(2))
    tokens, feats, target, mask = eagle_shift(batch["tokens"], batch["final"], batch["mask"], batch["valid"])
    pred = method.draft(params, base, cfg, batch["tokens"], feats, batch["valid"])[0]
    head = lm_head_weight(base).astype(jnp.float32)
    want, wm = eagle_loss(pred, target, head[rows], mask)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(gm["ploss"]), float(wm["ploss"]), rtol=1e-5)
    full = eagle_loss(pred, target, head, mask)[1]
    assert abs(float(full["ploss"]) - float(gm["ploss"])) > 1e-3


def test_eagle_training_time_test_loss():
    """EAGLE with steps=2: step 0's loss plus 0.8 x step 1's, where step 1 at t regresses the
    feature of t + 2 and counts where t + 1 is scored and t, t + 2 are real tokens."""
    from specjax import ModelConfig, init_params
    from specjax.training.trainers import lm_head_weight, make_method

    cfg = ModelConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        max_position_embeddings=64,
    )
    base = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    rng = np.random.default_rng(4)
    b, t = 2, 10
    mask = rng.random((b, t)) > 0.3
    valid = np.ones((b, t), bool)
    valid[1, 7:] = False
    final = rng.normal(size=(b, t, 16)).astype(np.float32)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, 40, (b, t)), jnp.int32),
        "final": jnp.asarray(final),
        "mask": jnp.asarray(mask),
        "valid": jnp.asarray(valid),
    }
    method = make_method("eagle", steps=2, noise_std=0.0)
    params = method.init_params(jax.random.PRNGKey(1), {"base": base}, cfg)
    got, gm = method.loss(params, {"base": base}, cfg, batch, jax.random.PRNGKey(2))
    preds = method.draft(params, base, cfg, batch["tokens"], batch["final"], batch["valid"])
    head = lm_head_weight(base).astype(jnp.float32)
    pad = lambda x, n: np.concatenate([x[:, n:], np.zeros_like(x[:, :n])], 1)
    m0 = mask & valid & pad(valid, 1)
    m1 = pad(mask, 1) & pad(valid, 1) & pad(valid, 2) & valid
    l0 = eagle_loss(preds[0], jnp.asarray(pad(final, 1)), head, jnp.asarray(m0))[0]
    l1 = eagle_loss(preds[1], jnp.asarray(pad(final, 2)), head, jnp.asarray(m1))[0]
    np.testing.assert_allclose(float(got), float(l0) + 0.8 * float(l1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gm["loss_k"]), [float(l0), float(l1)], rtol=1e-5)
    assert gm["acc_k"].shape == (2,)


@pytest.mark.parametrize("name", ["medusa", "redrafter"])
def test_sampled_loss_positions(name):
    """Scoring a random subset of positions: with every position drawn it is the full loss;
    with fewer, only drawn positions count and each draw is seeded by the step key."""
    from specjax.training.trainers import make_method

    rng = np.random.default_rng(6)
    b, t, d, v = 2, 16, 8, 30
    base = {"embed": jnp.asarray(rng.normal(size=(v, d)), jnp.float32)}
    cfg = type("C", (), {"hidden_size": d, "vocab_size": v})
    mask = np.zeros((b, t), bool)
    mask[0, 5:] = True
    mask[1, 9:14] = True
    batch = {
        "tokens": jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
        "final": jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32),
        "mask": jnp.asarray(mask),
        "valid": jnp.ones((b, t), bool),
    }
    opts = {"num_heads": 3} if name == "medusa" else {"steps": 3}
    full = make_method(name, **opts)
    params = full.init_params(jax.random.PRNGKey(0), {"base": base}, cfg)
    params = jax.tree_util.tree_map(lambda a: a + 0.1, params)
    key = jax.random.PRNGKey(1)
    want, wm = full.loss(params, {"base": base}, cfg, batch, key)
    got, gm = make_method(name, loss_positions=t, **opts).loss(params, {"base": base}, cfg, batch, key)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gm["acc_k"]), np.asarray(wm["acc_k"]), rtol=1e-6)
    few = make_method(name, loss_positions=3, **opts)
    a = few.loss(params, {"base": base}, cfg, batch, key)[0]
    assert float(a) == float(few.loss(params, {"base": base}, cfg, batch, key)[0])
    assert float(a) != float(few.loss(params, {"base": base}, cfg, batch, jax.random.PRNGKey(2))[0])
    from specjax.training.losses import labelled, sample_positions

    pos, ok = sample_positions(key, labelled(jnp.asarray(mask), 3), 3)
    elig = np.asarray(labelled(jnp.asarray(mask), 3))
    assert np.all(np.asarray(ok)) and all(elig[r, np.asarray(pos)[r]].all() for r in range(b))
    assert len(set(np.asarray(pos)[0])) == 3
    # More positions asked for than the batch is long (short sequences batched together): all.
    pos, ok = sample_positions(key, labelled(jnp.asarray(mask), 3), 4 * t)
    assert pos.shape == (b, t) and np.array_equal(np.asarray(ok).sum(1), elig.sum(1))
    assert float(
        make_method(name, loss_positions=4 * t, **opts).loss(params, {"base": base}, cfg, batch, key)[0]
    ) == pytest.approx(float(want), rel=1e-5)


def test_medusa_draft_vocab_loss():
    """Over the draft_ids rows: the loss of the full-vocabulary logits' columns at those rows,
    labels renumbered, labels outside the draft vocabulary not scored."""
    from specjax.training.trainers import make_method

    rng = np.random.default_rng(7)
    b, t, d, v = 2, 14, 8, 40
    base = {"embed": jnp.asarray(rng.normal(size=(v, d)), jnp.float32)}
    cfg = type("C", (), {"hidden_size": d, "vocab_size": v})
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = rng.random((b, t)) > 0.2
    batch = {
        "tokens": jnp.asarray(tokens),
        "final": jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32),
        "mask": jnp.asarray(mask),
        "valid": jnp.ones((b, t), bool),
    }
    ids = rng.permutation(v)[:25].astype(np.int32)
    frozen = {"base": base, "draft_ids": jnp.asarray(ids)}
    method = make_method("medusa", num_heads=3, draft_vocab_loss=True)
    params = method.init_params(jax.random.PRNGKey(0), frozen, cfg)
    params = jax.tree_util.tree_map(lambda a: a + 0.1, params)
    got, gm = method.loss(params, frozen, cfg, batch, jax.random.PRNGKey(1))
    full = np.asarray(method.logits(params, base, cfg, batch["final"]))
    index = np.full(v, -1)
    index[ids] = np.arange(len(ids))
    want, wm = medusa_loss(
        jnp.asarray(full[..., ids]), jnp.asarray(np.maximum(index[tokens], 0)), jnp.asarray(mask & (index[tokens] >= 0))
    )
    assert (index[tokens] < 0).any() and float(got) != float(
        medusa_loss(jnp.asarray(full), jnp.asarray(tokens), jnp.asarray(mask))[0]
    )
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gm["acc_k"]), np.asarray(wm["acc_k"]), rtol=1e-6)
    with pytest.raises(ValueError, match="shared lm_head"):
        make_method("medusa", draft_vocab_loss=True, own_lm_head=True)


def test_redrafter_loss_matches_torch():
    """Apple's drafter_loss: step i's logits[:, :-(i+2)] against labels[:, i+2:], summed."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    b, t, k, v = 2, 10, 3, 9
    logits = rng.normal(size=(b, t, k, v)).astype(np.float32)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = rng.random((b, t)) > 0.3
    loss, m = redrafter_loss(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    labels = torch.where(torch.tensor(mask), torch.tensor(tokens).long(), -100)
    want = sum(
        torch.nn.functional.cross_entropy(
            torch.tensor(logits[:, : -(i + 2), i]).reshape(-1, v), labels[:, i + 2 :].reshape(-1), ignore_index=-100
        ).item()
        for i in range(k)
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_redrafter_step_logits_follow_the_rnn():
    """Step i at position t reads [h_t; s_{i+1}], s_{j} = SiLU(W e(x_{t+j}) + U s_{j-1} + b)."""
    from specjax.training.trainers import make_method

    rng = np.random.default_rng(3)
    d, v, b, t = 8, 20, 2, 7
    method = make_method("redrafter", steps=3)
    base = {"embed": jnp.asarray(rng.normal(size=(v, d)), jnp.float32)}
    cfg = type("C", (), {"hidden_size": d, "vocab_size": v})
    params = method.init_params(jax.random.PRNGKey(0), {"base": base}, cfg)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    h = rng.normal(size=(b, t, d)).astype(np.float32)
    got = np.asarray(method.logits(params, {"base": base}, {"tokens": jnp.asarray(tokens), "final": jnp.asarray(h)}))
    p = jax.tree_util.tree_map(np.asarray, params)
    emb = np.asarray(base["embed"])
    silu = lambda x: x / (1 + np.exp(-x))
    for bi in range(b):
        for ti in range(t):
            s = np.zeros(d, np.float32)
            for i in range(3):
                nxt = tokens[bi, ti + 1 + i] if ti + 1 + i < t else None
                e = emb[nxt] if nxt is not None else np.zeros(d, np.float32)
                s = silu(e @ p["rnn_w"]["kernel"] + s @ p["rnn_u"]["kernel"] + p["rnn_u"]["bias"])
                x = np.concatenate([h[bi, ti], s])
                rb = p["resblocks"]["0"]
                x = x + silu(x @ rb["kernel"] + rb["bias"])
                np.testing.assert_allclose(got[bi, ti, i], x @ p["lm_head"].T, rtol=2e-4, atol=2e-4)


def test_eagle3_loss_matches_numpy():
    rng = np.random.default_rng(4)
    k, b, t, n = 3, 2, 8, 5
    logits = rng.normal(size=(k, b, t, n)).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = rng.normal(size=(b, t, n)).astype(np.float32) * 2
    in_vocab = rng.random((b, t)) > 0.2
    mask = rng.random((b, t)) > 0.3
    valid = np.ones((b, t), bool)
    valid[1, 6:] = False
    mask &= valid
    loss, m = eagle3_loss(
        jnp.asarray(logp), jnp.asarray(target), jnp.asarray(in_vocab), jnp.asarray(mask), jnp.asarray(valid)
    )
    tp = np.exp(target) / np.exp(target).sum(-1, keepdims=True)
    total = 0.0
    for i in range(k):
        acc_num = li = 0.0
        for bi in range(b):
            for ti in range(t):
                j = ti + 1 + i  # the target position step i at ti is scored on
                if j >= t or not (in_vocab[bi, j] and mask[bi, ti + i] and valid[bi, j]):
                    continue
                li -= (tp[bi, j] * logp[i, bi, ti]).sum()
                acc_num += logp[i, bi, ti].argmax() == tp[bi, j].argmax()
        li /= valid.sum()
        den = sum(mask[bi, ti + i] for bi in range(b) for ti in range(t) if ti + i < t) + 1e-6
        np.testing.assert_allclose(float(m["loss_k"][i]), li, rtol=1e-5)
        np.testing.assert_allclose(float(m["acc_k"][i]), acc_num / den, rtol=1e-5)
        total += 0.8**i * li
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)


def test_dflash_loss_matches_numpy():
    """Slot j of a block weighs exp(-j / gamma) (the paper's exp(-(k - 1) / gamma) for the k-th
    drafted token) in a weighted mean over scored slots; a block's accepted drafts are its
    leading correct slots."""
    from specjax.training.losses import dflash_decay_gamma, dflash_loss

    rng = np.random.default_rng(5)
    b, n, k, v, gamma = 2, 3, 4, 6, 2.5
    logits = rng.normal(size=(b, n, k, v)).astype(np.float32)
    labels = rng.integers(0, v, size=(b, n, k))
    labels[0, 0] = logits[0, 0].argmax(-1)  # a block drafted right: 4 accepted
    labels[0, 1, :2] = logits[0, 1, :2].argmax(-1)  # right up to slot 2: 2 accepted
    labels[0, 1, 2] = (logits[0, 1, 2].argmax() + 1) % v
    mask = rng.random((b, n, k)) > 0.25
    mask[0, :2] = True
    mask[1, 2] = False  # a block with no label: not counted
    loss, m = dflash_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask), gamma)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    w = np.exp(-np.arange(k) / gamma) * mask
    np.testing.assert_allclose(float(loss), (w * nll).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["loss_k"]), (nll * mask).sum((0, 1)) / mask.sum((0, 1)), rtol=1e-5)
    hit = (logits.argmax(-1) == labels) & mask
    np.testing.assert_allclose(np.asarray(m["acc_k"]), hit.sum((0, 1)) / mask.sum((0, 1)), rtol=1e-6)
    lead = [int(np.cumprod(hit[i, j]).sum()) for i in range(b) for j in range(n) if mask[i, j, 0]]
    assert lead[:2] == [4, 2]
    np.testing.assert_allclose(float(m["accepted"]), np.mean(lead), rtol=1e-6)
    assert [dflash_decay_gamma(s) for s in (8, 10, 16, 4, 32)] == [4.0, 5.0, 7.0, 4.0, 7.0]


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_unroll_equals_sequential_drafting(variant):
    """Step i of the training-time test at position t computes what the draft computes at test
    time after drafting i tokens from t: a cache of step-0 pairs 0..t, then its own outputs
    (EAGLE-3's unroll; EAGLE's with --draft-steps > 1)."""
    from specjax import ModelConfig, PagedKVCache, causal_mask, init_params
    from specjax.cache import init_pages
    from specjax.proposers.eagle3_net import draft_config, eagle3_forward, eagle3_fuse, eagle3_logprobs
    from specjax.proposers.eagle_net import eagle_forward
    from specjax.training.trainers import make_method

    cfg = ModelConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        max_position_embeddings=128,
    )
    base = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    rng = np.random.default_rng(5)
    b, t = 2, 8
    tokens = rng.integers(0, 40, (b, t)).astype(np.int32)
    valid = np.ones((b, t), bool)
    valid[1, 6:] = False
    batch = {"tokens": jnp.asarray(tokens), "valid": jnp.asarray(valid)}
    if variant == "eagle3":
        method = make_method("eagle3", steps=3, draft_vocab_size=24)
        layers = method.feature_layers(cfg)
        for i in set(layers):
            batch[f"layer_{i}"] = jnp.asarray(rng.normal(size=(b, t, 16)), jnp.float32)
        kept = np.sort(rng.permutation(40)[:24])
        frozen = {"base": base, "kept": jnp.asarray(kept), "d2t": jnp.asarray(kept - np.arange(24))}
        dcfg, forward = draft_config(cfg), eagle3_forward
    else:
        method = make_method("eagle", steps=3, num_layers=2)
        frozen = {"base": base}
        dcfg, forward = method.draft_config(cfg), eagle_forward
    params = method.init_params(jax.random.PRNGKey(1), frozen, cfg)
    params = jax.tree_util.tree_map(  # break the identity-like init
        lambda a: a + 0.3 * jax.random.normal(jax.random.PRNGKey(a.size), a.shape), params
    )
    if variant == "eagle3":
        got = np.asarray(method.unroll(params, frozen, cfg, batch))  # [K, B, T, N]
        feats = eagle3_fuse(params, jnp.concatenate([batch[f"layer_{i}"] for i in layers], -1))
        read = lambda h: eagle3_logprobs(params, dcfg, h)[0, 0]
    else:
        feats = jnp.asarray(rng.normal(size=(b, t, 16)), jnp.float32)
        got = np.asarray(method.draft(params, base, cfg, batch["tokens"], feats, batch["valid"]))  # [K, B, T, D]
        read = lambda h: h[0, 0]
    assert got.shape[0] == 3

    nxt = np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1)
    for bi, ti in ((0, 2), (1, 4)):
        k, v = init_pages(dcfg, 1, 32)
        cache = PagedKVCache(k, v, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))
        n = ti + 1
        x, cache = forward(
            params,
            dcfg,
            base["embed"],
            jnp.asarray(nxt[bi : bi + 1, :n]),
            feats[bi : bi + 1, :n],
            jnp.arange(n)[None],
            cache,
            causal_mask(1, n),
        )
        cache = cache.replace(lengths=cache.lengths + n)
        h = x[:, -1:]
        np.testing.assert_allclose(got[0, bi, ti], read(h), rtol=1e-4, atol=1e-4)
        for i in range(1, 3):
            if ti + 1 + i >= t:
                break
            tok = jnp.asarray([[tokens[bi, ti + 1 + i]]])
            h, cache = forward(params, dcfg, base["embed"], tok, h, jnp.asarray([[ti + i]]), cache, causal_mask(1, 1))
            cache = cache.replace(lengths=cache.lengths + 1)
            np.testing.assert_allclose(got[i, bi, ti], read(h), rtol=1e-4, atol=1e-4)


def test_grown_eagle_draft_starts_as_the_trained_one(tmp_path):
    """--num-layers 2 --init-heads <1-layer heads>: the added layer is the identity until
    trained, so the grown draft predicts exactly what the heads did; fewer layers are refused."""
    from specjax import ModelConfig, init_params
    from specjax.heads import save_heads
    from specjax.training.trainers import make_method

    cfg = ModelConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        max_position_embeddings=128,
    )
    base = init_params(cfg, jax.random.PRNGKey(0), scale=0.5)
    one = make_method("eagle")
    params = one.init_params(jax.random.PRNGKey(1), {"base": base}, cfg)
    params = jax.tree_util.tree_map(lambda a: a + 0.3 * jax.random.normal(jax.random.PRNGKey(a.size), a.shape), params)
    variables, meta = one.export(params, {}, cfg)
    save_heads(tmp_path / "h", "eagle", variables, meta)
    two = make_method("eagle", num_layers=2, steps=2)
    grown = two.params_from_heads(tmp_path / "h", cfg)
    assert len(grown["layers"]) == 2 and not np.any(np.asarray(grown["layers"][1]["wo"]))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 40, (2, 6)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)
    valid = jnp.ones((2, 6), bool)
    want = make_method("eagle", steps=2).draft(params, base, cfg, tokens, feats, valid)
    got = two.draft(grown, base, cfg, tokens, feats, valid)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    # the grown draft trains: its new layer's output projection gets a gradient
    grad = jax.grad(lambda p: sum(jnp.sum(x**2) for x in two.draft(p, base, cfg, tokens, feats, valid)))(grown)
    assert np.any(np.asarray(grad["layers"][1]["wo"]))
    variables, meta = two.export(grown, {}, cfg)
    save_heads(tmp_path / "h2", "eagle", variables, meta)
    with pytest.raises(ValueError, match="2 layers, the run asks for 1"):
        one.params_from_heads(tmp_path / "h2", cfg)


def test_eagle_noise_is_uniform_and_scaled_by_length():
    feats = jnp.zeros((2, 64, 32))
    lengths = jnp.asarray([64, 256])
    noise = np.asarray(uniform_feature_noise(jax.random.PRNGKey(0), feats, lengths, 0.2))
    for row, n in zip(noise, (64, 256)):
        half = 0.5 * 0.2 * 512 / n  # (U - 0.5) * std * 512 / n lies in [-half, half)
        assert np.abs(row).max() <= half and np.abs(row).max() > 0.95 * half
        assert abs(row.mean()) < 0.05 * half


def test_distill_order_keeps_a_prefix_of_the_selection():
    from specjax.training.data import length_sorted_windows

    items = [(i, [0] * n) for i, n in enumerate([5, 1, 4, 2, 9, 3, 7, 8, 6, 1])]
    out = length_sorted_windows(items, 4)
    assert [i for i, _ in out] == [1, 3, 2, 0, 5, 6, 7, 4, 9, 8]


def test_batch_order_is_a_seeded_permutation_per_epoch():
    n, bs = 10, 4
    ids = np.concatenate([batch_ids(s, bs, n, seed=3) for s in range(5)])  # 2 epochs
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:20]) == list(range(10))
    assert not np.array_equal(ids[:10], ids[10:20])
    assert np.array_equal(batch_ids(3, bs, n, seed=3), ids[12:16])
    assert not np.array_equal(batch_ids(0, bs, n, seed=4), ids[:4])


def test_length_grouped_batches():
    n, bs = 1003, 4
    lengths = np.random.default_rng(0).integers(1, 500, n)
    per_epoch = n // bs
    epoch = np.stack([batch_ids(s, bs, n, seed=1, lengths=lengths) for s in range(per_epoch)])
    # an epoch: whole batches, no sequence twice, all but n % bs of them
    assert len(np.unique(epoch)) == per_epoch * bs
    # batches of similar length: far less padding than random batches
    pad = lambda b: (lengths[b].max(1, keepdims=True) - lengths[b]).sum()
    rand = np.stack([batch_ids(s, bs, n, seed=1) for s in range(per_epoch)])
    assert pad(epoch) < 0.1 * pad(rand)
    # seeded and resumable: the same batch from the step alone; the next epoch differs
    assert np.array_equal(batch_ids(7, bs, n, seed=1, lengths=lengths), epoch[7])
    nxt = batch_ids(per_epoch + 7, bs, n, seed=1, lengths=lengths)
    assert not np.array_equal(nxt, epoch[7])
    assert not np.array_equal(batch_ids(7, bs, n, seed=2, lengths=lengths), epoch[7])
    # too few sequences to group: the plain permutation
    assert np.array_equal(batch_ids(1, bs, 6, seed=1, lengths=lengths[:6]), batch_ids(1, bs, 6, seed=1))


# ------------------------------------------------------------------------------------------
# Data stages


def test_distill_and_features_resume(setup, tmp_path):
    """A torn distillation file and a missing feature shard are redone, giving the same data."""
    from specjax.loading import load_model
    from specjax.training.features import FeatureStore, teacher_forward

    src = setup["data"]
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(src / "distill.json", data)
    lines = (src / "distill.jsonl").read_text().splitlines(keepends=True)
    (data / "distill.jsonl").write_text("".join(lines[:5]) + lines[5][:20])  # killed mid-write
    cfg = config("medusa", setup["base"], setup["prompts"], tmp_path / "o", data, until="features")
    run(cfg, progress=False)
    got = [json.loads(l) for l in (data / "distill.jsonl").read_text().splitlines()]
    want = [json.loads(l) for l in lines]
    assert sorted(got, key=lambda r: r["index"]) == sorted(want, key=lambda r: r["index"])
    assert any(r["answer_ids"] for r in got) and all(r["prompt_ids"] for r in got)

    # --only-distilled trains on the answered prompts alone (here: all ten).
    res = run(
        config(
            "medusa",
            setup["base"],
            setup["prompts"],
            tmp_path / "o2",
            data,
            until="distill",
            only_distilled=True,
            max_prompts=16,
        ),
        progress=False,
    )
    assert res["sequences"] == 10
    root = next((data / "features").iterdir())
    a = FeatureStore(root)
    # The stored features of a sequence equal an unbatched, unpadded teacher-forced pass.
    model = load_model(setup["base"], dtype=jnp.float32)
    for i in (0, len(a) - 1):
        s = a.sequence(i)
        n = len(s["tokens"])
        ref = teacher_forward(model.params, model.config, jnp.asarray(s["tokens"])[None], jnp.ones((1, n), bool))[
            "final"
        ][0]
        np.testing.assert_allclose(np.asarray(s["final"], np.float32), ref, atol=2e-3, rtol=2e-3)
        assert not s["mask"][0] and np.all(np.diff(s["mask"].astype(int)) >= 0)  # prompt, answer
    shutil.rmtree(root / "shard_00000")
    run(cfg, progress=False)
    b = FeatureStore(root)
    for i in range(len(a)):
        for k, v in a.sequence(i).items():
            np.testing.assert_array_equal(v, b.sequence(i)[k])


def test_extra_data_folders(setup, tmp_path):
    """--extra-data: a run trains on its own features followed by another folder's, unchanged."""
    from specjax.training.features import FeatureStore
    from specjax.training.train import TrainError, training_store

    prompts2 = tmp_path / "more.jsonl"
    prompts2.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "category": CATEGORIES[i % 3], "turns": [f"Tell me {i} facts about owls."]})
            + "\n"
            for i in range(6)
        )
    )
    data2 = tmp_path / "data2"
    run(
        config("medusa", setup["base"], prompts2, tmp_path / "prep2", data2, until="features", max_prompts=6),
        progress=False,
    )
    res = run(
        config(
            "medusa",
            setup["base"],
            setup["prompts"],
            tmp_path / "o",
            setup["data"],
            steps=4,
            save_every=4,
            eval_prompts=0,
            extra_data=(str(data2),),
        ),
        progress=False,
    )
    assert res["train_sequences"] == 16
    assert json.loads((Path(res["heads"]) / "specjax.json").read_text())["train_prompts"] == 16
    root = Path(res["features"])
    own, other = FeatureStore(root), FeatureStore(data2 / "features" / root.name)
    both = training_store(root, (str(data2),), setup["data"])
    assert len(both) == len(own) + len(other) == 16
    assert list(both.lengths) == list(own.lengths) + list(other.lengths)
    for i, (st, j) in {0: (own, 0), 9: (own, 9), 10: (other, 0), 15: (other, 5)}.items():
        for k, v in st.sequence(j).items():
            np.testing.assert_array_equal(both.sequence(i)[k], v)
    batch = both.batch([9, 10], 64)
    assert batch["valid"][1].sum() == min(64, other.lengths[0])
    with pytest.raises(TrainError, match="run's own data folder"):
        training_store(root, (str(setup["data"]),), setup["data"])
    with pytest.raises(TrainError, match=f"has no {root.name} features"):
        training_store(root, (str(tmp_path / "prep2"),), setup["data"])
    wide = tmp_path / "wide" / "features" / root.name  # another base model's features
    shutil.copytree(data2 / "features" / root.name, wide)
    meta = json.loads((wide / "meta.json").read_text())
    (wide / "meta.json").write_text(json.dumps({**meta, "hidden_size": meta["hidden_size"] * 2}))
    with pytest.raises(TrainError, match="do not match"):
        training_store(root, (str(tmp_path / "wide"),), setup["data"])


# ------------------------------------------------------------------------------------------
# Training runs: loss goes down, resumable with identical state, heads decode losslessly


def _heads(path):
    from specjax.heads import load_heads

    return load_heads(path)


def _generate(args, capsys):
    from specjax.cli import main

    assert main(args) == 0
    return [json.loads(l)["token_ids"] for l in capsys.readouterr().out.splitlines()]


METHOD_OPTIONS = {
    "medusa": (("draft_vocab_loss", True),),
    "eagle": (),
    "redrafter": (("draft_vocab_size", 200), ("steps", 3)),
    "eagle3": (("draft_vocab_size", 256), ("steps", 3)),
}


@pytest.mark.parametrize(
    "method", ["eagle"] + [pytest.param(m, marks=pytest.mark.slow) for m in ("medusa", "eagle3", "redrafter")]
)
def test_train_resume_and_decode(setup, method, tmp_path, capsys):
    base, prompts, data = setup["base"], setup["prompts"], setup["data"]
    # EAGLE's run takes batches of similar length (the others the plain permutation).
    opts = dict(method_options=METHOD_OPTIONS[method], group_by_length=method == "eagle")
    # Evaluation (Engine + the method's proposer) runs once; other methods decode below.
    full = config(method, base, prompts, tmp_path / "full", data, **opts, eval_prompts=3 if method == "medusa" else 0)
    res = run(full, progress=False)
    rows = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = np.mean([r["loss"] for r in rows[:4]]), np.mean([r["loss"] for r in rows[-4:]])
    assert last < first, (first, last)
    if "kl" in rows[0]:  # soft labels: the loss above its floor (the target's entropy) shrinks
        kl0, kl1 = np.mean([r["kl"] for r in rows[:4]]), np.mean([r["kl"] for r in rows[-4:]])
        assert kl1 < 0.8 * kl0, (kl0, kl1)
    else:
        assert last < first - 0.05 * abs(first), (first, last)
    assert (tmp_path / "full" / "checkpoints" / str(STEPS)).is_dir()
    assert (tmp_path / "full" / "loss.png").stat().st_size > 1000
    if method == "medusa":
        report = json.loads((tmp_path / "full" / "eval.json").read_text())
        assert set(report["categories"]) == set(CATEGORIES)

    # Interrupted: stop after 12 steps (checkpoints at 8 and 12), lose the last checkpoint as a
    # kill during step 12 would, resume from step 8 to the end: the same state, bit for bit.
    part = config(method, base, prompts, tmp_path / "part", data, eval_prompts=0, **opts)
    res_a = run(part, stop_after=12, progress=False)
    assert int(res_a["state"].step) == 12 and "heads" not in res_a
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "12")
    res_b = run(part, progress=False)
    assert int(res_b["state"].step) == STEPS
    chex.assert_trees_all_equal(jax.device_get(res["state"]), jax.device_get(res_b["state"]))
    rows_b = [json.loads(l) for l in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows]
    meta_a, var_a = _heads(tmp_path / "full" / "heads")
    _, var_b = _heads(tmp_path / "part" / "heads")
    chex.assert_trees_all_equal(var_a, var_b)
    assert meta_a["kind"] == method and meta_a["hidden_size"] == 64

    # The heads load and decode: greedy output equals vanilla decoding.
    heads = str(tmp_path / "full" / "heads")
    texts = ["Say hello to the fox.", "What is 2 + 2?"]
    gen = [
        "generate",
        "--model",
        base,
        "--prompt",
        texts[0],
        "--prompt",
        texts[1],
        "--max-new-tokens",
        "12",
        "--json",
        "--no-warmup",
    ]
    vanilla = _generate(gen, capsys)
    from specjax.methods import METHODS as CLI_METHODS

    if method in CLI_METHODS:
        assert _generate(gen + ["--method", method, "--heads", heads], capsys) == vanilla
        # with the prompt-lookup continuation grafted onto the tree
        assert _generate(gen + ["--method", method, "--heads", heads, "--lookup-tokens", "3"], capsys) == vanilla
    if method != "medusa":  # the trainer's own proposer (EAGLE: the chain drafter)
        from specjax.generate import Engine
        from specjax.loading import load_model
        from specjax.training.data import PromptRecord, encode_record
        from specjax.training.trainers import make_method

        model = load_model(base)
        proposer, pparams = make_method(method, **dict(METHOD_OPTIONS[method])).proposer(heads, model)
        enc = [encode_record(model.tokenizer, PromptRecord(p)) for p in texts]
        out = Engine(model.params, model.config, num_pages=64).generate(
            enc, 12, proposer=proposer, proposer_params=pparams
        )
        assert out.token_ids == vanilla


def test_dflash_train_and_decode(setup, tmp_path, capsys):
    """`specjax train --method dflash`: the block loss falls, the heads record the drafter's
    target layers, block size and a mask token the data never holds, and they decode (the CLI's
    `--method dflash --heads`, and `make_proposer` through the trainer) exactly like vanilla."""
    from specjax.cli import main
    from specjax.generate import Engine
    from specjax.loading import load_model
    from specjax.training.data import PromptRecord, encode_record
    from specjax.training.features import FeatureStore
    from specjax.training.trainers import make_method

    base, prompts, data, out = setup["base"], setup["prompts"], setup["data"], tmp_path / "dflash"
    args = ["train", "--method", "dflash", "--base", base, "--prompts", str(prompts), "--data", str(data)]
    args += ["--out", str(out), "--max-prompts", "10", "--max-new-tokens", "16", "--steps", str(STEPS)]
    args += ["--batch-size", "4", "--max-len", "64", "--lr", "3e-3", "--warmup", "4", "--eval-prompts", "0"]
    args += ["--block-size", "4", "--loss-positions", "8", "--no-progress"]
    assert main(args) == 0
    capsys.readouterr()
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and len(rows[0]["acc"]) == 3 and "accepted" in rows[0]
    first, last = np.mean([r["loss"] for r in rows[:4]]), np.mean([r["loss"] for r in rows[-4:]])
    assert last < first - 0.05 * first, (first, last)
    meta, _ = _heads(out / "heads")
    assert (meta["kind"], meta["block_size"], meta["target_layers"]) == ("dflash", 4, [1])
    store = FeatureStore(data / "features" / "l1-float16")
    seen = np.concatenate([store.sequence(i)["tokens"] for i in range(len(store))])
    assert meta["mask_token_id"] not in seen and meta["mask_token_id"] == max(set(range(320)) - set(seen))

    texts = ["Say hello to the fox.", "What is 2 + 2?"]
    gen = ["generate", "--model", base, "--prompt", texts[0], "--prompt", texts[1], "--max-new-tokens", "12"]
    gen += ["--json", "--no-warmup"]
    vanilla = _generate(gen, capsys)
    assert _generate(gen + ["--method", "dflash", "--heads", str(out / "heads")], capsys) == vanilla
    model = load_model(base)
    proposer, pparams = make_method("dflash", block_size=4).proposer(out / "heads", model)
    assert (proposer.block_size, proposer.feature_layers) == (4, (1,))
    enc = [encode_record(model.tokenizer, PromptRecord(p)) for p in texts]
    got = Engine(model.params, model.config, num_pages=64).generate(enc, 12, proposer=proposer, proposer_params=pparams)
    assert got.token_ids == vanilla


def test_bad_output_folders_and_heads(setup, tmp_path, capsys):
    from conftest import make_tiny_hf_model

    from specjax.cli import main
    from specjax.heads import save_heads

    base, prompts, data = setup["base"], setup["prompts"], setup["data"]
    common = [
        "--base",
        base,
        "--prompts",
        str(prompts),
        "--data",
        str(data),
        "--max-prompts",
        "10",
        "--max-new-tokens",
        "16",
        "--distill-batch-size",
        "4",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--max-len",
        "64",
        "--eval-prompts",
        "0",
        "--no-progress",
    ]
    out = tmp_path / "m"
    assert main(["train", "--method", "medusa", "--out", str(out), *common]) == 0
    assert (out / "heads" / "specjax.json").exists()
    capsys.readouterr()

    def error(args):
        rc = main(["train", *args])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and len(err.splitlines()) == 1, err
        return err

    # Another method's checkpoint in the output folder.
    assert "holds a medusa training run" in error(["--method", "eagle", "--out", str(out), *common])
    # The same run with another batch order.
    assert "group_by_length=False" in error(["--method", "medusa", "--out", str(out), "--group-by-length", *common])
    # ... or with more data folders.
    assert "extra_data=[]" in error(["--method", "medusa", "--out", str(out), "--extra-data", str(tmp_path), *common])
    only_heads = tmp_path / "h"
    shutil.copytree(out / "heads", only_heads / "heads")
    assert "holds medusa heads" in error(["--method", "eagle", "--out", str(only_heads), *common])
    # Heads made for another hidden size.
    wrong = tmp_path / "wrong"
    variables = {
        "params": {
            "head_0": {
                "ResBlock_0": {"Dense_0": {"kernel": np.zeros((48, 48), np.float32), "bias": np.zeros(48, np.float32)}}
            }
        }
    }
    save_heads(
        wrong,
        "medusa",
        variables,
        {"num_heads": 1, "num_layers": 1, "hidden_size": 48, "vocab_size": 320, "own_lm_head": False},
    )
    err = error(
        ["--method", "medusa", "--out", str(tmp_path / "n"), "--init-heads", str(wrong), "--num-heads", "1", *common]
    )
    assert "hidden_size 48" in err
    # A base model of another hidden size than the run already in the folder.
    other = tmp_path / "other_base"
    make_tiny_hf_model(other, "llama", hidden_size=48, num_attention_heads=4)
    capsys.readouterr()
    args = ["--method", "medusa", "--out", str(out), *common]
    args[args.index("--base") + 1] = str(other)
    assert "hidden_size 64" in error(args)


# ------------------------------------------------------------------------------------------
# Data parallelism over a `data` mesh axis


@pytest.mark.slow
def test_data_parallel_matches_single_device(tmp_path):
    """With two (host) devices the batch is split over `data`; the result matches one device."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from specjax import ModelConfig, init_params
        from specjax.training.features import FeatureSpec, FeatureStore, extract_features
        from specjax.training.trainers import make_method
        from specjax.training.train import OptimConfig, Sharder, fit
        assert jax.device_count() == 2
        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
        base = init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
        rng = np.random.default_rng(0)
        seqs = []
        for n in rng.integers(10, 40, 12):
            toks = rng.integers(0, 64, n).astype(np.int32)
            seqs.append((toks, np.arange(n) >= 4))
        root = extract_features(base, cfg, seqs, r"{tmp_path}", FeatureSpec(dtype="float32"),
                                batch_size=4, progress=False)
        store = FeatureStore(root)
        sh = Sharder(4)
        x = sh.batch(store.batch([0, 1, 2, 3], 64))["final"]
        assert len(x.sharding.device_set) == 2 and x.addressable_shards[0].data.shape[0] == 2
        opt = OptimConfig(lr=3e-3, steps=6, warmup=2)
        results = []
        for name, devices in (("two", None), ("one", jax.devices()[:1])):
            for method in (make_method("eagle"),):  # attention, K/V writes and noise on shards
                st = fit(method, cfg, base, store, r"{tmp_path}/" + name + method.name, opt,
                         batch_size=4, max_len=64, seed=0, save_every=3, progress=False,
                         devices=devices)
                results.append(jax.device_get(st.params))
        for a, b in zip(results[:1], results[1:]):
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
        print("OK")
    """)
    env = dict(os.environ, XLA_FLAGS=xla_flags(2), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_features_extend_when_the_data_grows(setup, tmp_path):
    """More answered prompts in the same order extend a feature folder: its full shards are
    kept, the partial one is redone; another order or fewer sequences are refused."""
    from specjax.loading import load_model
    from specjax.training.features import FeatureStore, extract_features

    model = load_model(setup["base"], dtype=jnp.float32)
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(3, 300, n).astype(np.int32), np.arange(n) >= 2) for n in (5, 9, 4, 7, 6, 8, 3)]

    def extract(folder, s):
        return extract_features(model.params, model.config, s, folder, batch_size=2, shard_size=2, progress=False)

    root = extract(tmp_path / "a", seqs[:5])
    kept = (root / "shard_00000" / "final.npy").stat().st_mtime_ns
    assert extract(tmp_path / "a", seqs) == root
    assert (root / "shard_00000" / "final.npy").stat().st_mtime_ns == kept
    grown, fresh = FeatureStore(root), FeatureStore(extract(tmp_path / "b", seqs))
    assert len(grown) == len(seqs)
    for i in range(len(seqs)):
        for k, v in fresh.sequence(i).items():
            np.testing.assert_array_equal(v, grown.sequence(i)[k])
    other = list(seqs)
    other[1] = (other[1][0][::-1].copy(), other[1][1])
    with pytest.raises(ValueError, match="num_sequences=7, not 8"):
        extract(tmp_path / "a", other + [seqs[0]])
    with pytest.raises(ValueError, match="num_sequences=7, not 3"):
        extract(tmp_path / "a", seqs[:3])
    assert len(FeatureStore(root)) == len(seqs)


def test_ship_takes_decoding_defaults_as_json_or_a_file(tmp_path, capsys):
    """`python -m specjax.training.ship` writes float16 heads with the recommended settings, given as
    JSON text or as a file; unreadable JSON is a one-line error and writes nothing."""
    import types

    from specjax import ModelConfig, init_params
    from specjax.heads import load_heads
    from specjax.random_heads import random_head_checkpoint
    from specjax.training.ship import main as ship

    cfg = ModelConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    target = types.SimpleNamespace(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    random_head_checkpoint("medusa", target, tmp_path / "run")
    defaults = {"medusa": {"medusa_choices": [[0], [1], [0, 0], [0, 1]] * 20}}  # > 255 chars
    (tmp_path / "d.json").write_text(json.dumps(defaults))
    for name, given in (("a", json.dumps(defaults)), ("b", str(tmp_path / "d.json"))):
        ship([str(tmp_path / "run"), str(tmp_path / name), "--defaults", given])
        meta, tensors = load_heads(tmp_path / name)
        assert meta["decoding_defaults"] == defaults and meta["weights_dtype"] == "float16"
    capsys.readouterr()
    for bad in ("{medusa", str(tmp_path / "missing.json"), "[1, 2]"):
        with pytest.raises(SystemExit):
            ship([str(tmp_path / "run"), str(tmp_path / "c"), "--defaults", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert "--defaults is neither a JSON object nor a file" in err[-1]
        assert not (tmp_path / "c").exists()
