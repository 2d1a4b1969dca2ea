"""FasterDecoding Medusa heads convert, load with --heads, and compute what the original computes."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.cli import main
from specjax.heads import load_heads
from specjax.proposers.medusa import MedusaProposer


class TorchResBlock(torch.nn.Module):  # the public format's module layout
    def __init__(self, d):
        super().__init__()
        self.linear = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.linear(x))


def write_faster_decoding_heads(path, hidden, vocab, num_heads=3, num_layers=1, seed=0):
    torch.manual_seed(seed)
    heads = torch.nn.ModuleList(
        [
            torch.nn.Sequential(
                *[TorchResBlock(hidden) for _ in range(num_layers)], torch.nn.Linear(hidden, vocab, bias=False)
            )
            for _ in range(num_heads)
        ]
    )
    path.mkdir(parents=True, exist_ok=True)
    torch.save(heads.state_dict(), path / "medusa_lm_head.pt")
    (path / "config.json").write_text(
        json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny"})
    )
    return heads


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory):
    d, model = tiny_llama
    cfg = model.config
    root = tmp_path_factory.mktemp("medusa")
    torch_heads = write_faster_decoding_heads(root / "fd", cfg.hidden_size, cfg.vocab_size, num_layers=2)
    assert main(["convert", str(root / "fd"), "--out", str(root / "sj")]) == 0
    return d, torch_heads, root


def test_converted_heads_compute_the_same_logits(converted):
    _, torch_heads, root = converted
    meta, variables = load_heads(root / "sj", "medusa")
    assert (meta["num_heads"], meta["num_layers"]) == (3, 2)
    proposer = MedusaProposer(num_heads=3, num_layers=2, vocab_size=meta["vocab_size"], medusa_choices=((0, 0, 0),))
    x = torch.randn(4, meta["hidden_size"])
    with torch.no_grad():
        want = torch.stack([h(x) for h in torch_heads], dim=1).numpy()
    got = np.asarray(proposer.heads.apply(variables, jnp.asarray(x.numpy())))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_generate_with_medusa_heads_equals_vanilla(converted, capsys):
    d, _, root = converted
    base = [
        "generate",
        "--model",
        str(d),
        "--raw",
        "--json",
        "--max-new-tokens",
        "10",
        "--prompt",
        "The quick brown fox",
        "--prompt",
        "1 + 1 =",
    ]
    assert main(base) == 0
    vanilla = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert (
        main(base + ["--method", "medusa", "--heads", str(root / "sj"), "--medusa-choices", "[[0, 0, 0], [1], [0, 1]]"])
        == 0
    )
    medusa = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [m["token_ids"] for m in medusa] == [v["token_ids"] for v in vanilla]


def test_named_tree(converted):
    """`mc_sim_7b_63` names Medusa's tree (cut to the heads there are); other names are refused."""
    from specjax.loading import load_model
    from specjax.methods import MethodError, make_proposer
    from specjax.proposers.medusa import MC_SIM_7B_63

    d, _, root = converted
    model = load_model(str(d))
    proposer, _ = make_proposer("medusa", model, heads=str(root / "sj"), medusa_choices="mc_sim_7b_63")
    assert proposer.tree_size == 1 + sum(len(c) <= 3 for c in MC_SIM_7B_63)
    with pytest.raises(MethodError, match="unknown medusa_choices 'mc_sim_7b_64'"):
        make_proposer("medusa", model, heads=str(root / "sj"), medusa_choices="mc_sim_7b_64")


@pytest.mark.parametrize(
    "case,words",
    [
        ("no-heads", ["--heads"]),
        ("wrong-hidden", ["hidden_size"]),
        ("model-dir", ["not draft heads"]),
        ("bad-choices", ["medusa-choices"]),
        ("too-deep", ["deep"]),
    ],
)
def test_medusa_errors(converted, tmp_path, capsys, case, words):
    d, _, root = converted
    args = ["generate", "--model", str(d), "--prompt", "hi", "--method", "medusa"]
    if case == "wrong-hidden":
        write_faster_decoding_heads(tmp_path / "fd", 48, 320)
        assert main(["convert", str(tmp_path / "fd"), "--out", str(tmp_path / "sj")]) == 0
        capsys.readouterr()
        args += ["--heads", str(tmp_path / "sj")]
    elif case == "model-dir":
        assert main(["convert", str(d), "--out", str(tmp_path / "m")]) == 0
        capsys.readouterr()
        args += ["--heads", str(tmp_path / "m")]
    elif case == "bad-choices":
        args += ["--heads", str(root / "sj"), "--medusa-choices", "[[0], oops]"]
    elif case == "too-deep":
        args += ["--heads", str(root / "sj"), "--medusa-choices", "[[0, 0, 0, 0]]"]
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err


def test_typical_acceptance_through_the_cli(converted, capsys):
    d, _, root = converted
    rc = main(
        [
            "generate",
            "--model",
            str(d),
            "--raw",
            "--json",
            "--max-new-tokens",
            "10",
            "--prompt",
            "The quick brown fox",
            "--method",
            "medusa",
            "--heads",
            str(root / "sj"),
            "--temperature",
            "0.7",
            "--posterior-threshold",
            "0.09",
            "--posterior-alpha",
            "0.3",
        ]
    )
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    assert 1 <= rec["new_tokens"] <= 10 and 1 <= rec["steps"] <= rec["new_tokens"]
