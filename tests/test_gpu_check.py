"""benchmarks/gpu_check.py cannot arrive broken at a GPU: its smoke run and its CUDA pre-flight
(tp = 2 for every method, dp = 2 x tp = 2; tp = 1 is the same programs on one device) run here,
and decoding under a mesh with the kernel in
interpret mode (under shard_map) equals decoding on one device."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ("environment", "kernel", "methods", "sampling", "decode", "peer", "oracle", "verify", "attention", "tiles")


def run(args, devices: int = 1, timeout: int = 900, script=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = xla_flags(devices if devices > 1 else None)
    cmd = [sys.executable, "-c", script] if script else [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def script_methods() -> tuple[str, ...]:
    """The methods gpu_check.py runs (its METHODS), read from the script without running it."""
    for node in ast.parse(SCRIPT.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["METHODS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("gpu_check.py defines no METHODS")


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path):
    pytest.importorskip("torch")  # the peer section runs transformers
    r = run(["--smoke", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert tuple(data["sections"]) == SECTIONS
    for name, entry in data["sections"].items():
        assert "error" not in entry and entry.get("ok", True), (name, entry)
    methods = data["sections"]["methods"]["rows"]
    assert {r["method"] for r in methods} == set(script_methods())
    assert all(r["identical_to_vanilla"] for r in methods)
    oracle = data["sections"]["oracle"]["rows"]
    assert [r["measured_tokens_per_step"] for r in oracle] == [2, 3, 4, 6]
    assert all(r["same_tokens_as_vanilla"] for r in oracle)
    md = (tmp_path / "results.md").read_text()
    assert all(f"## {s}" in md for s in SECTIONS)


def test_without_gpu_says_so_in_one_line():
    from specjax.attention import gpu_supports_kernel

    if gpu_supports_kernel():  # there the command would start the whole GPU run
        pytest.skip("a CUDA GPU is present")
    r = run([])
    assert r.returncode == 2
    assert "no CUDA GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "tp,dp,methods",
    [  # every method's programs lowered in the default tier
        (2, 1, ",".join(script_methods())),
        pytest.param(2, 2, "vanilla,eagle2", marks=pytest.mark.slow),
    ],
)
def test_preflight_lowers_every_program_for_cuda(tp, dp, methods):
    """Every program holds the kernel, and on a mesh each device's kernel reads only its own KV
    heads (the kernel inside shard_map, not the pools gathered)."""
    r = run(["--lower-only", "--tp", str(tp), "--dp", str(dp), "--methods", methods], devices=tp * dp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert sum("spec_loop[" in line for line in lines) == len(methods.split(",")) - 1
    assert sum("advance[" in line for line in lines) == len(methods.split(",")) - 1  # the budget's
    assert all(line.endswith("ok") for line in lines)


MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "benchmarks")
    import gpu_check
    from specjax.attention import use_attention_backend
    from specjax import Engine
    from specjax.sharding import make_mesh

    target = gpu_check.tiny_target()
    out = {}
    for name, backend, mesh in (("one", "xla", None), ("tp2", "pallas-interpret", make_mesh(tp=2)),
                                ("dp2tp2", "pallas-interpret", make_mesh(tp=2, dp=2))):
        with use_attention_backend(backend):
            engine = Engine(target.params, gpu_check.TINY, num_pages=96, page_size=16, mesh=mesh)
            for method in ("vanilla", "eagle2"):
                proposer, pparams = gpu_check.method_proposer(method, target)
                got = engine.generate(gpu_check.PROMPTS, 8, eos_token_ids=(), proposer=proposer,
                                      proposer_params=pparams)
                out[f"{name}/{method}"] = got.token_ids
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_mesh_decoding_with_kernel_equals_one_device():
    r = run([], devices=4, script=MESH_SCRIPT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = out["one/vanilla"]
    assert all(len(t) == 8 for t in want)
    for key, tokens in out.items():
        assert tokens == want, key
