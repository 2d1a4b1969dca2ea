"""`specjax bench`: a tiny run writes results.json, results.md and results.png that agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specjax.bench import BenchError, MethodSpec, read_bench_prompts
from specjax.cli import main


@pytest.fixture()
def prompt_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    recs = [
        {"category": "code", "turns": ["def add(a, b):"]},
        {"category": "chat", "prompt": "The quick brown fox"},
        {"category": "chat", "turns": ["Hello! How are you today?"]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return f


def test_tiny_bench_writes_consistent_outputs(tiny_llama, prompt_file, tmp_path, capsys, monkeypatch):
    from specjax.generate import Engine

    timed = []  # every timed run prefills its whole prompt: none reuses another run's pages
    real = Engine.generate

    def spy(self, prompts, *args, warmup=False, **kw):
        if not warmup:
            timed.append(all(self.allocator.match_prefix(p[:-1]) == [] for p in prompts))
        return real(self, prompts, *args, warmup=warmup, **kw)

    monkeypatch.setattr(Engine, "generate", spy)
    out = tmp_path / "bench"
    args = [
        "bench",
        "--model",
        str(tiny_llama[0]),
        "--methods",
        "vanilla,pld:prompt_lookup_num_tokens=3",
        "--prompts",
        str(prompt_file),
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        "--peers",
        "hf",
    ]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert (out / "results.png").stat().st_size > 1000
    peers = [r for r in res["rows"] if r["library"] == "transformers"]
    assert {(r["category"], r["method"]) for r in peers} == {
        (c, m) for c in ("code", "chat") for m in ("hf-vanilla", "hf-pld", "hf-assisted")
    }
    assert all(r["speedup_vs_own_vanilla"] == 1.0 for r in peers if r["method"] == "hf-vanilla")
    rows = [r for r in res["rows"] if r["library"] == "specjax"]
    assert {(r["category"], r["method"]) for r in rows} == {
        (c, m) for c in ("code", "chat") for m in ("vanilla", "pld:prompt_lookup_num_tokens=3")
    }
    for r in rows:
        assert r["tokens_per_s"] > 0
        assert r["greedy_equals_vanilla"] == f"{r['prompts']}/{r['prompts']}"
        assert r["decode_tokens_per_s"] > r["tokens_per_s"]  # the prefill's time left out
        if r["method"] == "vanilla":
            assert r["speedup_vs_vanilla"] == 1.0 and r["mean_accepted"] == 1.0
            assert r["decode_speedup_vs_vanilla"] == 1.0
    assert [r["prompts"] for r in rows if r["method"] == "vanilla"] == [1, 2]
    assert len(timed) == 6 and all(timed)
    # The markdown table and the JSON agree, row by row.
    table = (out / "results.md").read_text().splitlines()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| category")]
    assert len(body) == len(res["rows"])
    body = [line for line in body if "transformers" not in line]
    for line, r in zip(body, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == r["category"] and cells[1] == r["method"]
        assert float(cells[2]) == r["mean_accepted"] and float(cells[3]) == r["tokens_per_s"]
        assert cells[4] == f"{r['speedup_vs_vanilla']:.2f}x"
        assert cells[6] == f"{r['decode_speedup_vs_vanilla']:.2f}x"
    assert all(r["decode_speedup_vs_vanilla"] is None for r in peers)
    printed = capsys.readouterr().out.strip()
    assert printed == "\n".join(line for line in table[2:] if line.startswith("|"))
    # A second run over the same folder resumes: nothing is recomputed.
    before = (out / "records.jsonl").read_text()
    assert main(args) == 0
    assert (out / "records.jsonl").read_text() == before


def test_resume_reruns_a_record_whose_prompt_changed(tiny_llama, tmp_path):
    """Another --limit spreads the picks differently: a record at the same (category, index) but
    of another prompt is run again, not reused."""
    from specjax.bench import prompt_sha

    texts = ["one two three", "four five six", "seven eight", "nine ten"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"category": "chat", "prompt": t}) + "\n" for t in texts))
    out = tmp_path / "bench"
    args = [
        "bench",
        "--model",
        str(tiny_llama[0]),
        "--methods",
        "vanilla",
        "--prompts",
        str(f),
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    ]
    assert main(args + ["--limit", "2"]) == 0  # texts 0 and 2, as indices 0 and 1
    assert main(args) == 0  # all four: index 0 reused, 1 (now text 1) run again, 2 and 3 new
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 1, 2, 3]
    assert {r["index"]: r["prompt_sha"] for r in recs} == {i: prompt_sha({"text": t}) for i, t in enumerate(texts)}
    res = json.loads((out / "results.json").read_text())
    assert [r["prompts"] for r in res["rows"]] == [4]


def test_sampled_bench_is_seeded_and_compares_no_outputs(tiny_llama, prompt_file, tmp_path, capsys):
    """--temperature/--top-p: every method samples; rows say nothing of equal outputs; with
    --fixed-speculation the same seed gives the same tokens, another seed other tokens (with the
    budget, the widths and so the draws depend on measured time: same distribution, other draws)."""

    def run(out, seed):
        args = [
            "bench",
            "--model",
            str(tiny_llama[0]),
            "--methods",
            "vanilla,pld",
            "--prompts",
            str(prompt_file),
            "--max-new-tokens",
            "16",
            "--out",
            str(out),
            "--temperature",
            "1.0",
            "--top-p",
            "0.9",
            "--seed",
            str(seed),
            "--fixed-speculation",
        ]
        assert main(args) == 0
        res = json.loads((out / "results.json").read_text())
        recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        return res, {(r["category"], r["index"], r["method"]): r["token_ids"] for r in recs}

    res, a = run(tmp_path / "a", 3)
    assert res["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 0.9} and res["seed"] == 3
    assert all(r["greedy_equals_vanilla"] is None for r in res["rows"])
    assert [r["mean_accepted"] for r in res["rows"] if r["method"] == "vanilla"] == [1.0, 1.0]
    assert run(tmp_path / "b", 3)[1] == a
    before = (tmp_path / "a" / "records.jsonl").read_text()
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "--model",
                str(tiny_llama[0]),
                "--prompts",
                str(prompt_file),
                "--out",
                str(tmp_path / "a"),
                "--max-new-tokens",
                "16",
                "--temperature",
                "1.0",
                "--top-p",
                "0.9",
                "--seed",
                "4",
                "--fixed-speculation",
            ]
        )
        != 0
    )  # seed-3 records there: no silent mix
    assert "other settings (seed 3 -> 4)" in capsys.readouterr().err
    assert (tmp_path / "a" / "records.jsonl").read_text() == before
    assert run(tmp_path / "c", 4)[1] != a
    assert main(["bench", "--prompts", str(prompt_file), "--out", str(tmp_path / "d"), "--temperature", "-1"]) != 0
    assert "--temperature must be >= 0" in capsys.readouterr().err


def test_method_specs_and_prompt_errors(tmp_path):
    spec = MethodSpec.parse("eagle2:eagle_total_tokens=16:eagle_depth=3")
    assert spec.method == "eagle2" and dict(spec.options) == {"eagle_total_tokens": 16, "eagle_depth": 3}
    with pytest.raises(BenchError, match="unknown method 'nope'"):
        MethodSpec.parse("nope")
    with pytest.raises(BenchError, match="not key=value"):
        MethodSpec.parse("pld:oops")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json}\n')
    with pytest.raises(BenchError, match="bad.jsonl:2"):
        read_bench_prompts(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "category": "x"}\n')
    with pytest.raises(BenchError, match="no prompts of category y"):
        read_bench_prompts(good, ["y"])


def test_forward_cost_benchmark_on_a_tiny_model():
    """benchmarks/bench_forward_cost.py times every part at every width, relative to width 1."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    import jax

    from specjax import ModelConfig, init_params

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_forward_cost.py"
    spec = importlib.util.spec_from_file_location("bench_forward_cost", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_ids=(),
    )
    model = SimpleNamespace(params=init_params(cfg, jax.random.PRNGKey(0), scale=0.3), config=cfg)
    rows = mod.measure(model, [1, 4], context=20, iters=2)
    assert [r["width"] for r in rows] == [1, 4] and rows[0]["cost_vs_width_1"] == 1.0
    for r in rows:
        assert all(r[k] > 0 for k in ("forward", "no_head", "mlps", "lm_head"))
    assert "| 4 |" in mod.markdown(rows, 20)


def test_draft_agreement_scores_tv_and_agreement():
    """benchmarks/draft_agreement.py: q = p agrees everywhere with 1 - TV = 1; a draft over part
    of the vocabulary scores sum(min(p, q)) there, and p's mass on that part."""
    import importlib.util
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_agreement.py"
    spec = importlib.util.spec_from_file_location("draft_agreement", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    logits = 3.0 * jax.random.normal(jax.random.PRNGKey(0), (6, 11))
    same = np.asarray(mod.step_sums(logits, logits, jnp.arange(11), 1.0, 1.0))
    np.testing.assert_allclose(same, [6, 6, 6], rtol=1e-5)
    assert np.asarray(mod.step_sums(logits, logits, jnp.arange(11), 1.0, 2.0))[2] < 5.5
    ids = jnp.array([4, 1, 7])
    got = np.asarray(mod.step_sums(logits, jnp.zeros((6, 3)), ids, 0.5, 1.0))
    p = np.asarray(jax.nn.softmax(logits / 0.5, -1))[:, np.asarray(ids)]
    agree = np.sum(np.asarray(ids)[0] == np.argmax(np.asarray(logits), -1))  # q's argmax: ids[0]
    np.testing.assert_allclose(got, [agree, p.sum(), np.minimum(p, 1 / 3).sum()], rtol=1e-5)


def test_step_profile_attributes_ops_to_phases(tmp_path):
    """benchmarks/profile_step.py reads each op's phase from the optimized HLO's op_name."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "module_0001.jit_spec_loop.cpu_after_optimizations.txt").write_text(
        "  %ffi_call.7 = f32[4,9]{1,0} custom-call(%a, %b), metadata={op_name="
        '"jit(spec_loop)/while/body/verify/cond/branch_1_fun/ffi_call" stack_frame_id=3}\n'
        "  ROOT %fusion.2 = f32[2]{0} fusion(%c), metadata={op_name="
        '"jit(spec_loop)/while/body/propose/while/body/dot_general"}\n'
        "  %add.1 = f32[2]{0} add(%d, %e)\n"
    )
    scopes = mod.op_scopes(str(tmp_path))
    assert set(scopes) == {"ffi_call.7", "fusion.2"}
    assert [mod.phase_of(scopes[k]) for k in ("ffi_call.7", "fusion.2")] == ["verify", "propose"]
    assert mod.phase_of("jit(spec_loop)/while/body/add") == "other"


def test_decode_speedup_leaves_out_the_shared_prefill():
    """summarize: decode tokens/s = new tokens / (seconds - prefill_seconds), summed over the
    category's prompts; records of runs that kept no prefill time give no decode figures."""
    from specjax.bench import summarize

    def rec(method, index, seconds, prefill, steps):
        r = {
            "category": "chat",
            "index": index,
            "method": method,
            "tokens": 10,
            "seconds": seconds,
            "steps": steps,
            "token_ids": [1] * 10,
        }
        if prefill is not None:
            r["prefill_seconds"] = prefill
        return r

    prompts = [{"category": "chat", "index": i} for i in (0, 1)]
    recs = [
        rec("vanilla", 0, 3.0, 1.0, 10),
        rec("vanilla", 1, 5.0, 1.0, 10),
        rec("eagle2", 0, 2.0, 1.0, 4),
        rec("eagle2", 1, 3.0, 1.0, 5),
    ]
    rows = summarize({(r["category"], r["index"], r["method"]): r for r in recs}, prompts, ["vanilla", "eagle2"])
    van, eagle = rows
    assert van["decode_tokens_per_s"] == round(20 / 6, 2) and van["decode_speedup_vs_vanilla"] == 1.0
    assert eagle["decode_tokens_per_s"] == round(20 / 3, 2) and eagle["decode_speedup_vs_vanilla"] == 2.0
    assert eagle["speedup_vs_vanilla"] == round((20 / 5) / (20 / 8), 3)  # whole requests: 1.6x
    old = [dict(r) for r in recs]
    del old[3]["prefill_seconds"]
    rows = summarize({(r["category"], r["index"], r["method"]): r for r in old}, prompts, ["vanilla", "eagle2"])
    assert rows[1]["decode_tokens_per_s"] is None and rows[1]["decode_speedup_vs_vanilla"] is None
    assert rows[1]["speedup_vs_vanilla"] == 1.6


def test_bench_keeps_compiled_programs_until_its_memory_limit(tiny_llama, prompt_file, tmp_path, monkeypatch):
    """Programs are dropped between prompts only above keep_programs_gib or near the kernel's
    memory-mapping limit; either way the records are the same tokens."""
    import jax

    from specjax import bench
    from specjax.bench import resident_gib, run_bench

    assert 0 < resident_gib() < 1024
    cleared = []
    real = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), real())[1])

    def tokens(out, limit):
        run_bench(
            str(tiny_llama[0]),
            ["vanilla", "pld"],
            prompt_file,
            out,
            max_new_tokens=8,
            progress=False,
            keep_programs_gib=limit,
        )
        recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        return {(r["category"], r["index"], r["method"]): r["token_ids"] for r in recs}

    kept = tokens(tmp_path / "kept", 1024.0)
    assert not cleared
    assert tokens(tmp_path / "dropped", 0.0) == kept
    between = len({(c, i) for c, i, _ in kept}) - 1  # between prompts
    assert len(cleared) == between
    # near the kernel's memory-mapping limit they are dropped whatever the memory held
    monkeypatch.setattr(bench, "mapping_share", lambda: bench.KEEP_MAPPING_SHARE + 0.01)
    assert tokens(tmp_path / "near_map_limit", 1024.0) == kept
    assert len(cleared) == 2 * between


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_mapping_share_reads_this_process():
    from specjax.bench import mapping_share

    assert 0 < mapping_share() < 1


def test_plot_labels_wrap_at_option_separators():
    from specjax.bench import _wrapped

    label = (
        "eagle2:lookup_tokens=6:min_matching_ngram_size=2:eagle_draft_vocab=4096:"
        "lookup_width=14:eagle_total_tokens=12:eagle_depth=4:eagle_top_k=3"
    )
    lines = _wrapped(label, width=40).split("\n")
    assert "".join(lines) == label and len(lines) > 1
    assert all(len(line) <= 40 for line in lines)
    assert all(line.startswith(":") for line in lines[1:])  # cut only before a separator
    assert _wrapped("vanilla") == "vanilla"
    assert _wrapped("x" * 50, width=10) == "x" * 50  # one part longer than a line stays whole
