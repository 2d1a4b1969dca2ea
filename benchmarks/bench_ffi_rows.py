"""Would a hand-written CPU kernel make a T-token verify cheaper than XLA's matrix product?

    python benchmarks/bench_ffi_rows.py                 # widths 1 2 4 8, needs g++ with AVX2

The experiment behind README "What one verify pass costs": `ffi_rows_matmul.cc` (AVX2 + FMA,
each weight row read once for all T rows, split over XLA's intra-op threads) is built here and
called through an XLA FFI custom call, against `specjax.model.linear` / `head_logits` on the
embedded model's own weights: every linear layer of the 30 decoder layers, and the 49152-row
lm_head. Each timed inside one jitted `fori_loop` (benchmarks/bench_forward_cost.py's
`loop_ms`, best of 3). Not used by specjax itself: see the README for why.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from bench_forward_cost import loop_ms
from specjax import load_model
from specjax.bench import machine
from specjax.model import head_logits, linear, lm_head_weight

SOURCE = Path(__file__).with_name("ffi_rows_matmul.cc")
WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def build_and_register(workdir: Path) -> None:
    """Compile the kernel and register it as the CPU FFI target `rows_matmul`."""
    lib = workdir / "ffi_rows_matmul.so"
    subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c++17",
                    "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(lib)], check=True)
    handler = ctypes.cdll.LoadLibrary(str(lib)).SpecjaxRowsMatmul
    jax.ffi.register_ffi_target("rows_matmul", jax.ffi.pycapsule(handler), platform="cpu")


def ffi_linear(x, w):
    """x [T, in] times w [out, in] -> [T, out] through the custom call."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("rows_matmul", out)(x, w)


def measure(params, widths, iters: int) -> list[dict]:
    layers = [{k: layer[k].astype(jnp.float32) for k in WEIGHTS} for layer in params["layers"]]
    head = lm_head_weight(params).astype(jnp.float32)
    d = head.shape[1]
    rows = []
    for t in widths:
        def stack(lin):
            def body(p, acc):  # in sequence, each input as wide as its weight takes
                y = jnp.zeros((t, d), jnp.float32) + acc
                for layer in p:
                    for k in WEIGHTS:
                        w = layer[k]
                        y = lin(jnp.broadcast_to(y[:, :1], (t, w.shape[1])), w)
                return acc + y[0, 0]
            return body

        def head_body(lin):
            return lambda w, acc: acc + lin(jnp.zeros((t, d), jnp.float32) + acc, w)[0, 0]

        r = {"width": t}
        r["layers_xla"] = loop_ms(stack(linear), layers, jnp.float32(0), iters)
        r["layers_ffi"] = loop_ms(stack(ffi_linear), layers, jnp.float32(0), iters)
        r["head_xla"] = loop_ms(head_body(head_logits), head, jnp.float32(0), iters)
        r["head_ffi"] = loop_ms(head_body(ffi_linear), head, jnp.float32(0), iters)
        rows.append({k: round(v, 2) if k != "width" else v for k, v in r.items()})
    return rows


def markdown(rows) -> str:
    out = ["Milliseconds per pass over T rows: the 120 linear layers of the 30 decoder layers, "
           "and the lm_head; XLA (`specjax.model.linear` / `head_logits`) against the FFI kernel",
           "", "| T | layers, XLA | layers, kernel | lm_head, XLA | lm_head, kernel |",
           "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['width']} | {r['layers_xla']} | {r['layers_ffi']} | {r['head_xla']} | "
                   f"{r['head_ffi']} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ffi_rows"))
    args = ap.parse_args(argv)
    if any(not 1 <= w <= 8 for w in args.widths):
        ap.error("the kernel takes 1 to 8 rows")
    with tempfile.TemporaryDirectory() as tmp:
        build_and_register(Path(tmp))
        rows = measure(load_model(args.model).params, args.widths, args.iters)
    table = markdown(rows)
    result = {"machine": machine(), "model": args.model, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".md").write_text(f"{result['machine']}, {args.model}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
