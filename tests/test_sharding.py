"""Tensor/data parallel decoding over a device mesh, and across two processes.

The multi-device checks need XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX
starts, so they run in one subprocess (SCRIPT) that prints its findings as JSON; two more
processes meanwhile form one 2-device mesh over jax.distributed (gloo) through the CLI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import contextlib, dataclasses, io, json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    from specjax import Engine, ModelConfig, init_params
    from specjax.model import lm_head_weight
    from specjax.proposers.eagle import EagleDynamicProposer
    from specjax.proposers.lookup_graft import LookupGraftProposer
    from specjax.proposers.medusa import MedusaProposer
    from specjax.proposers.prompt_lookup import PromptLookupProposer
    from specjax.sharding import ShardingError, make_mesh, shard_params

    out = {"devices": len(jax.devices())}
    CFG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=256)
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    NEW = 16  # a small vocabulary, so that every method's drafts are accepted at times
    PROMPTS = [[3, 9, 27, 17, 31, 25, 11, 13, 15, 21], [5, 5, 5, 6], [1, 2]]

    medusa = MedusaProposer(num_heads=3, vocab_size=CFG.vocab_size, own_lm_head=True,
                            medusa_choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    heads = medusa.init_params(jax.random.PRNGKey(1), CFG.hidden_size)
    heads = jax.tree_util.tree_map(  # random (not identity) ResBlocks: arbitrary drafts
        lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), heads)
    draft_cfg = dataclasses.replace(CFG, num_layers=1)
    layer = init_params(draft_cfg, jax.random.PRNGKey(3), scale=0.3)["layers"][0]
    del layer["attn_norm"]
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    net = {"fc": {"kernel": 0.3 * jax.random.normal(k1, (2 * CFG.hidden_size, CFG.hidden_size)),
                  "bias": 0.3 * jax.random.normal(k2, (CFG.hidden_size,))}, "layers": [layer]}
    METHODS = {
        "vanilla": (None, None),
        "pld": (PromptLookupProposer(4, 2), None),
        "medusa": (medusa, {"heads": heads, "lm_head": lm_head_weight(params)}),
        "eagle2": (EagleDynamicProposer(draft_cfg, total_tokens=10, depth=3, top_k=3),
                   {"net": net, "embed": params["embed"], "lm_head": lm_head_weight(params)}),
    }
    small = EagleDynamicProposer(draft_cfg, total_tokens=4, depth=2, top_k=2)
    METHODS["eagle2-lookup"] = (LookupGraftProposer(small, PromptLookupProposer(3, 2)),
                                METHODS["eagle2"][1])

    def run(mesh):
        eng = Engine(params, CFG, num_pages=64, page_size=4, mesh=mesh)
        res = {}
        for name, (proposer, pparams) in METHODS.items():
            o = eng.generate(PROMPTS, NEW, eos_token_ids=(), proposer=proposer,
                             proposer_params=pparams, fixed_speculation=True)
            res[name] = {"tokens": o.token_ids, "steps": o.steps}
        done = {r.index: r for r in eng.generate_continuous(PROMPTS, NEW, slots=2, refill=1,
                                                            eos_token_ids=())}
        res["continuous"] = {"tokens": [done[i].token_ids for i in range(len(PROMPTS))],
                             "steps": [done[i].steps for i in range(len(PROMPTS))]}
        return eng, res

    # Sampling: drawn trees under `recursive` (EAGLE-2), top-p under `match` (Medusa), vanilla.
    from specjax.sampling import SamplingConfig
    SAMPLED = {"vanilla": (None, None, SamplingConfig(temperature=1.0)),
               "medusa": (*METHODS["medusa"], SamplingConfig(temperature=0.8, top_p=0.9)),
               "eagle2-recursive": (dataclasses.replace(METHODS["eagle2"][0], rule="recursive"),
                                    METHODS["eagle2"][1], SamplingConfig(temperature=1.0))}

    def sampled(eng):
        return {name: eng.generate(PROMPTS, NEW, sampling=s, seeds=[7, 8, 9], eos_token_ids=(),
                                   proposer=p, proposer_params=pp, fixed_speculation=True).token_ids
                for name, (p, pp, s) in SAMPLED.items()}

    eng, out["one_device"] = run(None)
    out["sampled"] = {"one_device": sampled(eng)}
    out["meshes"] = {}
    # Tensor parallel alone (tp=4) and with data parallel (tp=2 x dp=2); a tp=2 x dp=1 run as
    # well only repeated what these two prove (the verify step's collectives at tp=2 are below).
    for tp, dp in [(4, 1), (2, 2)]:
        eng, res = run(make_mesh(tp, dp))
        out["meshes"][f"tp{tp}_dp{dp}"] = res
        if (tp, dp) == (2, 2):
            out["sampled"]["tp2_dp2"] = sampled(eng)
        if (tp, dp) == (2, 2):  # the server's scheduler on the mesh (rows over "data" once 2+)
            from specjax.serving.scheduler import Scheduler
            served = {}
            for name in ("vanilla", "eagle2"):
                sched = Scheduler(eng, *METHODS[name], max_batch=4, admit_group=2,
                                  eos_token_ids=()).start()
                handles = [sched.submit(p, NEW) for p in PROMPTS]
                served[name] = [h.result(timeout=300) for h in handles]
                sched.stop()
            out["served_tp2_dp2"] = served
        if (tp, dp) == (4, 1):  # per-device shard shapes of every weight and of the KV pools
            shards = {}
            for k, a in eng.params["layers"][0].items():
                shards["layers.0." + k] = [list(a.shape), [list(s.data.shape) for s in a.addressable_shards]]
            for k in ("embed", "norm"):
                a = eng.params[k]
                shards[k] = [list(a.shape), [list(s.data.shape) for s in a.addressable_shards]]
            a = eng.k_pages[0]
            shards["k_pages.0"] = [list(a.shape), [list(s.data.shape) for s in a.addressable_shards]]
            pp = eng._sharded(*METHODS["eagle2"])
            a = pp["net"]["layers"][0]["wq"]
            shards["eagle.wq"] = [list(a.shape), [list(s.data.shape) for s in a.addressable_shards]]
            a = eng._proposer_pools[METHODS["eagle2"][0]][0][0]
            shards["eagle.k_pages.0"] = [list(a.shape), [list(s.data.shape) for s in a.addressable_shards]]
            out["shards"] = shards

    # Collectives of the compiled verify step (a 5-node chain) on one device and on tp=2.
    from specjax.cache import PagedKVCache, init_pages
    from specjax.draft_tree import chain
    from specjax.sharding import put_batch, sharded_init
    from specjax.verify import verify

    def verify_hlo(mesh):
        p = params if mesh is None else shard_params(params, CFG, mesh)
        make = lambda: init_pages(CFG, 16, 4)
        k, v = make() if mesh is None else sharded_init(mesh, make)
        put = jnp.asarray if mesh is None else (lambda x: put_batch(mesh, x))
        cache = PagedKVCache(k, v, put(np.arange(16, dtype=np.int32).reshape(2, 8)),
                             put(np.asarray([5, 7], np.int32)))
        tree = chain(put(np.asarray([1, 2], np.int32)), put(np.ones((2, 4), np.int32)),
                     put(np.asarray([4, 4], np.int32)))
        f = jax.jit(lambda p, c, t: verify(p, CFG, c, t).logits)
        return f.lower(p, cache, tree).compile().as_text()

    out["hlo_allreduce"] = {name: verify_hlo(m).count(" all-reduce(")
                            for name, m in (("one_device", None), ("tp2", make_mesh(2, 1)))}

    errors = {}
    for name, fn in (("too_many_devices", lambda: make_mesh(tp=4, dp=4)),
                     ("kv_heads", lambda: Engine(params, CFG, num_pages=8, mesh=make_mesh(8)))):
        try:
            fn()
            errors[name] = None
        except ShardingError as e:
            errors[name] = str(e)
    out["errors"] = errors

    # The CLI on one device: the reference of the two-process run.
    from specjax.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(sys.argv[1:])
    out["cli_rc"] = rc
    out["cli"] = [json.loads(l)["token_ids"] for l in buf.getvalue().splitlines() if l.startswith("{")]
    print("RESULT " + json.dumps(out))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """(8-device script results, [stdout of the two processes' CLI runs])."""
    tmp = tmp_path_factory.mktemp("sharding")
    script = tmp / "mesh_checks.py"
    script.write_text(SCRIPT)
    cli_args = [
        "generate",
        "--model",
        str(tiny_llama[0]),
        "--method",
        "pld",
        "--raw",
        "--json",
        "--no-warmup",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--prompt",
        "Hello! How are you today?",
        "--prompt",
        "def add(a, b):",
    ]
    base = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    base["XLA_FLAGS"] = xla_flags()
    main = subprocess.Popen(
        [sys.executable, str(script), *cli_args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**base, "XLA_FLAGS": xla_flags(8)},
    )
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specjax.cli",
                *cli_args,
                "--tp",
                "2",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=base,
        )
        for i in range(2)
    ]
    try:
        mp = [p.communicate(timeout=400) for p in procs]
        out, err = main.communicate(timeout=400)
    finally:
        for p in [main, *procs]:
            if p.poll() is None:
                p.kill()
    assert main.returncode == 0, err[-3000:]
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), [(p.returncode, o, e) for p, (o, e) in zip(procs, mp)]


@pytest.mark.parametrize("mesh", ["tp4_dp1", "tp2_dp2"])
def test_greedy_outputs_match_one_device(runs, mesh):
    res, _ = runs
    assert res["devices"] == 8
    ref = res["one_device"]
    # The methods are lossless: every one reproduces vanilla greedy decoding on one device ...
    for name in ("pld", "medusa", "eagle2", "eagle2-lookup"):
        assert ref[name]["tokens"] == ref["vanilla"]["tokens"], name
    assert all(len(t) == 16 for t in ref["vanilla"]["tokens"])
    for name in ("pld", "medusa", "eagle2", "eagle2-lookup"):  # drafts were accepted: commits moved K/V
        assert sum(ref[name]["steps"]) < 3 * 16, name
    # ... and so does each on the mesh, drafting the same trees (same step counts).
    for name, r in res["meshes"][mesh].items():
        assert r["tokens"] == ref["vanilla"]["tokens"], (mesh, name)
        assert r["steps"] == ref[name]["steps"], (mesh, name)


def test_sampled_outputs_match_one_device(runs):
    """Sampled decoding on a tp=2, dp=2 mesh draws the same tokens as on one device for the
    same seeds (vanilla; Medusa under `match` with top-p; EAGLE-2's drawn trees under
    `recursive`), so the one-device lossless tests (test_accept_sampling.py) hold on a mesh."""
    out, _ = runs
    one, mesh = out["sampled"]["one_device"], out["sampled"]["tp2_dp2"]
    assert mesh == one
    greedy = out["one_device"]
    assert one["vanilla"] != greedy["vanilla"]["tokens"]  # sampled, not greedy


def test_the_server_scheduler_on_a_mesh_gives_the_one_device_answers(runs):
    """`specjax serve --tp 2 --dp 2`'s scheduler: every answer is one-device vanilla's."""
    res, _ = runs
    for name, tokens in res["served_tp2_dp2"].items():
        assert tokens == res["one_device"]["vanilla"]["tokens"], name


def test_weights_and_pools_are_split(runs):
    shards = runs[0]["shards"]  # tp = 4
    col = ["layers.0.wq", "layers.0.wk", "layers.0.wv", "layers.0.w_gate", "layers.0.w_up", "eagle.wq"]
    for name in col + ["embed"]:  # [out, in] (embed [vocab, D]): outputs split
        (n, d), parts = shards[name]
        assert len(parts) == 4 and all(p == [n // 4, d] for p in parts), name
    for name in ("layers.0.wo", "layers.0.w_down"):  # inputs split
        (d, m), parts = shards[name]
        assert len(parts) == 4 and all(p == [d, m // 4] for p in parts), name
    for name in ("k_pages.0", "eagle.k_pages.0"):  # [KVH, pages, page, D] over KV heads
        shape, parts = shards[name]
        assert all(p == [shape[0] // 4] + shape[1:] for p in parts), name
    assert all(p == shards["norm"][0] for p in shards["norm"][1])  # replicated
    assert "layers.0.wqkv" not in shards and "layers.0.w_gate_up" not in shards


def test_verify_step_reduces_after_row_parallel_products(runs):
    counts = runs[0]["hlo_allreduce"]
    assert counts["one_device"] == 0
    assert counts["tp2"] >= 2 * 2  # o_proj and down_proj of each of the 2 layers


def test_bad_meshes_give_one_line_errors(runs):
    errors = runs[0]["errors"]
    assert errors["too_many_devices"] == ("tp=4 x dp=4 needs 16 devices, but only 8 cpu device(s) exist")
    assert errors["kv_heads"] == "tp=8 does not divide the model's 4 KV heads"


def test_two_processes_form_one_mesh(runs):
    res, mp = runs
    assert res["cli_rc"] == 0 and len(res["cli"]) == 2
    for i, (rc, _, err) in enumerate(mp):
        assert rc == 0, f"process {i}: {err[-3000:]}"
    records = [
        [json.loads(l) for l in out.splitlines() if l.startswith("{")] for _, out, _ in mp
    ]  # (gloo logs its connections on stdout)
    assert [r["token_ids"] for r in records[0]] == res["cli"]
    assert records[1] == []  # only process 0 prints


def test_cli_refuses_bad_parallel_options(capsys):
    from specjax.cli import main

    assert main(["generate", "--prompt", "x", "--tp", "64"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("specjax: error: tp=64 x dp=1 needs 64 devices") and "\n" not in err
    assert main(["generate", "--prompt", "x", "--coordinator", "127.0.0.1:1"]) == 1
    assert "--num-processes" in capsys.readouterr().err
