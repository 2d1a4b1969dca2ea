"""GPU benchmark of the Pallas tree-paged-attention kernel: achieved HBM bandwidth vs the peak.

    python benchmarks/bench_kernels.py                 # Llama-3-8B heads, B x T x context grid
    python benchmarks/bench_kernels.py --xla           # also time the XLA reference
    python benchmarks/bench_kernels.py --roofline      # H100 roofline table (any machine)

One attention layer (32 query heads, 8 KV heads, head dim 128, bfloat16, pages of 16 slots) per
configuration; every sequence holds `context` committed tokens and a tree of T nodes (a chain
mask). Achieved bandwidth counts the bytes the kernel must move at least (K/V of every visible
slot once, q, output, tables, masks), so it is comparable with the peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H100 = {"name": "H100 SXM5", "hbm_bytes_per_s": 3.35e12, "bf16_flops": 989e12}
# HBM peak by `device_kind` substring (vendor datasheets), first match wins.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("A10", 0.6e12),
    ("RTX 4090", 1.008e12),
    ("RTX 3090", 0.936e12),
]
SHAPES = dict(h=32, kvh=8, d=128, page_size=16, dtype_bytes=2)


def traffic(b, t, context, *, h, kvh, d, page_size, dtype_bytes, k_splits=1, rows_padded=None):
    """(bytes, flops) of one attention layer: minimum HBM traffic and useful matmul FLOPs."""
    keys = context + t
    kv = 2 * b * kvh * keys * d * dtype_bytes
    qo = 2 * b * t * h * d * dtype_bytes
    tables = b * (-(-keys // page_size)) * 4 + b * t * t
    partials = 0 if k_splits == 1 else 2 * b * kvh * k_splits * (rows_padded or t * h // kvh) * (d + 2) * 4
    flops = 4 * b * h * t * keys * d  # q.k and p.v
    return kv + qo + tables + partials, flops


def roofline_table(dev=H100) -> str:
    """Markdown roofline of the grid on `dev` (per layer; x32 for all of Llama-3-8B)."""
    from specjax.kernels_pallas.tree_paged_attention import default_blocks

    bw, peak = dev["hbm_bytes_per_s"], dev["bf16_flops"]
    lines = [
        "| B | T | context | bytes moved (MB) | GFLOP | FLOP/byte | memory time (us) | "
        "compute time (us) | expected (us) | bound | splits | programs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for context in (2048, 8192):
        for b in (1, 8, 32):
            for t in (1, 8, 64):
                g = SHAPES["h"] // SHAPES["kvh"]
                block_q, _, splits, _ = default_blocks(
                    b, t, SHAPES["h"], SHAPES["kvh"], SHAPES["page_size"], context + 64
                )
                rows = -(-t * g // block_q) * block_q
                nbytes, flops = traffic(b, t, context, k_splits=splits, rows_padded=rows, **SHAPES)
                t_mem, t_cmp = nbytes / bw * 1e6, flops / peak * 1e6
                lines.append(
                    f"| {b} | {t} | {context // 1024}k | {nbytes / 1e6:.1f} | {flops / 1e9:.2f} | "
                    f"{flops / nbytes:.0f} | {t_mem:.1f} | {t_cmp:.1f} | {max(t_mem, t_cmp):.1f} "
                    f"| {'memory' if t_mem >= t_cmp else 'compute'} | {splits} "
                    f"| {b * SHAPES['kvh'] * rows // block_q * splits} |"
                )
    return "\n".join(lines)


def peak_bandwidth(kind: str, override: float | None) -> float | None:
    if override:
        return override * 1e9
    for key, value in PEAK_BANDWIDTH:
        if key.lower() in kind.lower():
            return value
    return None


def make_inputs(b, t, context, seed=0, *, h, kvh, d, page_size, dtype_bytes):
    """Random bf16 pools holding `context` committed slots per sequence plus the tree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    del dtype_bytes
    n = -(-(context + t) // page_size)
    num_pages = b * n
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    pool = (kvh, num_pages + 1, page_size, d)
    k = jax.random.normal(keys[0], pool, jnp.bfloat16)
    v = jax.random.normal(keys[1], pool, jnp.bfloat16)
    q = jax.random.normal(keys[2], (b, t, h, d), jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(num_pages).reshape(b, n).astype(np.int32)
    lengths = jnp.full((b,), context, jnp.int32)
    tree = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return q, k, v, jnp.asarray(perm), lengths, tree


def time_fn(fn, args, iters):
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tree", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--xla", action="store_true", help="also time the XLA reference")
    ap.add_argument("--peak-gbps", type=float, help="HBM peak in GB/s (unknown devices)")
    ap.add_argument("--roofline", action="store_true", help="print the H100 roofline and exit")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.roofline:
        print(roofline_table())
        return 0

    import jax

    from specjax.attention import gpu_supports_kernel
    from specjax.kernels_pallas.tree_paged_attention import default_blocks, tree_paged_attention
    from specjax.kernels_pallas.tree_paged_attention_reference import tree_paged_attention_reference

    if not gpu_supports_kernel():
        sys.exit(
            f"bench_kernels: needs a CUDA GPU of compute capability >= 8.0 (JAX's default "
            f"backend is {jax.default_backend()}); `--roofline` works anywhere"
        )
    dev = jax.devices()[0]
    peak = peak_bandwidth(dev.device_kind, args.peak_gbps)
    print(f"# {dev.device_kind}, HBM peak {'unknown (pass --peak-gbps)' if peak is None else f'{peak / 1e9:.0f} GB/s'}")
    kernel = jax.jit(tree_paged_attention)
    reference = jax.jit(tree_paged_attention_reference)
    print(
        "| B | T | context | kernel (us) | GB/s | % of peak | TFLOP/s |" + (" XLA (us) | speedup |" if args.xla else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|---|" if args.xla else ""))
    results = []
    for context in args.context:
        for b in args.batch:
            for t in args.tree:
                inputs = make_inputs(b, t, context, **SHAPES)
                g = SHAPES["h"] // SHAPES["kvh"]
                block_q, _, splits, _ = default_blocks(
                    b, t, SHAPES["h"], SHAPES["kvh"], SHAPES["page_size"], inputs[3].shape[1] * SHAPES["page_size"]
                )
                nbytes, flops = traffic(
                    b, t, context, k_splits=splits, rows_padded=-(-t * g // block_q) * block_q, **SHAPES
                )
                sec = time_fn(kernel, inputs, args.iters)
                row = {
                    "batch": b,
                    "tree": t,
                    "context": context,
                    "kernel_us": sec * 1e6,
                    "gbps": nbytes / sec / 1e9,
                    "tflops": flops / sec / 1e12,
                    "peak_fraction": None if peak is None else nbytes / sec / peak,
                }
                frac = "-" if peak is None else f"{100 * row['peak_fraction']:.0f}%"
                line = f"| {b} | {t} | {context} | {sec * 1e6:.1f} | {row['gbps']:.0f} | {frac} | {row['tflops']:.1f} |"
                if args.xla:
                    try:
                        ref = time_fn(reference, inputs, max(1, args.iters // 4))
                        row["xla_us"] = ref * 1e6
                        line += f" {ref * 1e6:.1f} | {ref / sec:.2f}x |"
                    except Exception as e:  # the dense reference may not fit at 8k x 32
                        row["xla_error"] = type(e).__name__
                        line += f" {type(e).__name__} | - |"
                print(line, flush=True)
                results.append(row)
                del inputs
    if args.json:
        args.json.write_text(
            json.dumps({"device": dev.device_kind, "peak_bytes_per_s": peak, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
