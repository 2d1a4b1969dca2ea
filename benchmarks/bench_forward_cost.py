"""What a verify pass of T tokens costs relative to one decode token, on this machine.

    python benchmarks/bench_forward_cost.py                  # widths 1 2 4 8 16, context 512
    python benchmarks/bench_forward_cost.py --widths 1 8 --context 256 --iters 20

Speculative decoding pays off when a step's tokens are worth more than its cost: a method that
verifies T nodes per step needs at least cost(T) / cost(1) tokens per step to break even (before
drafting costs). On a GPU cost(T) is nearly flat in T; on a CPU the small matrix products turn
compute-bound, which caps every method's speedup. Each width is timed inside one jitted
`fori_loop` with the cache donated (so no pool is copied between calls), the K/V writes deferred
as in `verify_pruned`, logits for every node. The parts: the whole forward, the decoder without
the lm_head, the MLPs alone and the lm_head alone; and a whole T-node chain through
`verify_pruned` itself (which pads 5-7 nodes to 8 and 9-15 to 16, the widths this measures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax import load_model
from specjax.attention import use_attention_backend
from specjax.bench import machine
from specjax.cache import PagedKVCache, init_pages, pages_needed
from specjax.cpu.matmul import pack_params, take_rows, unpack_params, unsupported_reason, use_cpu_matmul
from specjax.draft_tree import chain
from specjax.model import compute_logits, forward, mlp_block
from specjax.verify import verify_pruned


def loop_ms(body, params, carry, iters: int, repeats: int = 3) -> float:
    """Milliseconds per iteration of carry = body(params, carry) in one jitted fori_loop, the
    best of `repeats` timings (a shared machine's other load only ever adds time)."""
    f = jax.jit(lambda p, c, n: jax.lax.fori_loop(0, n, lambda i, c: body(p, c), c), donate_argnums=(1,))
    carry = jax.block_until_ready(f(params, carry, 1))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        carry = jax.block_until_ready(f(params, carry, iters))
        best = min(best, (time.perf_counter() - t) / iters * 1e3)
    return best


def cache_at(config, context: int, width: int, page_size: int = 16) -> PagedKVCache:
    """One sequence holding `context` committed slots (random K/V) with room for `width` more."""
    pages = pages_needed(context + width, page_size)
    k, v = init_pages(config, pages, page_size)
    key = jax.random.PRNGKey(0)
    k = [jax.random.normal(jax.random.fold_in(key, i), a.shape, a.dtype) for i, a in enumerate(k)]
    table = jnp.arange(pages, dtype=jnp.int32)[None]
    return PagedKVCache(k, v, table, jnp.array([context], jnp.int32))


def measure(model, widths, context: int, iters: int, matmul: str = "auto", attention: str = "auto") -> list[dict]:
    """Rows of milliseconds per part and width, with the linear layers on `matmul` (a
    specjax.cpu.matmul setting: XLA's product or the few-row kernel) and attention on the
    `attention` backend (specjax.attention: the XLA reference or the CPU kernel)."""
    with use_cpu_matmul(matmul), use_attention_backend(attention):
        params = pack_params(unpack_params(model.params))  # packed for the kernel
        rows = _measure(params, model.config, widths, context, iters)
    return [{"matmul": matmul, "attention": attention, **r} for r in rows]


def _measure(params, config, widths, context, iters):
    rows = []
    for w in widths:

        def tokens(acc):
            return jnp.zeros((1, w), jnp.int32) + acc.astype(jnp.int32) % 7

        def whole(p, c, head=True):
            cache, acc = c
            pos = cache.lengths[:, None] + jnp.arange(w)[None]
            mask = jnp.tril(jnp.ones((1, w, w), bool))
            out = forward(
                p,
                config,
                tokens(acc),
                pos,
                cache,
                mask,
                defer_kv_write=True,
                logits_at=None if head else jnp.zeros((1, 0), jnp.int32),
            )
            return cache, acc + (out.logits[0, -1, 0] if head else out.hidden[0, -1, 0])

        def mlps(p, c):
            cache, acc = c
            x = take_rows(p["embed"], tokens(acc))
            for layer in p["layers"]:
                x = mlp_block(layer, config, x)
            return cache, acc + x[0, -1, 0]

        def head(p, c):
            cache, acc = c
            return cache, acc + compute_logits(p, take_rows(p["embed"], tokens(acc)))[0, -1, 0]

        def pruned(p, c):
            cache, acc = c
            toks = tokens(acc)
            tree = chain(toks[:, 0], toks[:, 1:], jnp.full((1,), w - 1, jnp.int32))
            logits, _, cache = verify_pruned(p, config, cache, tree)
            return cache, acc + logits[0, -1, 0]

        parts = {}
        for name, body in [
            ("forward", whole),
            ("no_head", lambda p, c: whole(p, c, False)),
            ("mlps", mlps),
            ("lm_head", head),
            ("verify_pruned", pruned),
        ]:
            carry = (cache_at(config, context, w), jnp.float32(0))
            parts[name] = loop_ms(body, params, carry, iters)
        rows.append({"width": w, **{k: round(v, 2) for k, v in parts.items()}})
    base = rows[0]["forward"]
    for r in rows:
        r["cost_vs_width_1"] = round(r["forward"] / base, 2)
    return rows


def markdown(rows, context: int) -> str:
    out = [
        f"Target forward over T new tokens after {context} committed ones (ms; "
        "`cost_vs_width_1` = tokens per step needed to break even; matmul: the linear layers "
        "on XLA's product or specjax.cpu.matmul's kernel; attention: the XLA reference or "
        "specjax.cpu.attention's kernel)",
        "",
        "| matmul | attention | T | forward | decoder without lm_head | MLPs only | "
        "lm_head only | cost vs T=1 | `verify_pruned` |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.get('matmul', 'auto')} | {r.get('attention', 'auto')} | {r['width']} "
            f"| {r['forward']} | {r['no_head']} "
            f"| {r['mlps']} | {r['lm_head']} | {r['cost_vs_width_1']}x | "
            f"{r['verify_pruned']} |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--arms",
        nargs="+",
        default=None,
        help="MATMUL/ATTENTION settings to time one after the other, e.g. "
        "kernel/cpu (default: xla/xla, then kernel/xla and kernel/cpu when "
        "this machine can build the kernels)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "forward_cost"))
    args = ap.parse_args(argv)
    if args.widths[0] != 1:
        args.widths = [1] + [w for w in args.widths if w != 1]
    arms = args.arms or ["xla/xla"] + (["kernel/xla", "kernel/cpu"] if unsupported_reason() is None else [])
    model = load_model(args.model)
    rows = []
    for arm in arms:
        matmul, sep, attention = arm.partition("/")
        if not sep:
            ap.error(f"arm '{arm}' is not MATMUL/ATTENTION (e.g. kernel/cpu)")
        rows += measure(model, args.widths, args.context, args.iters, matmul, attention)
    table = markdown(rows, args.context)
    result = {"machine": machine(), "model": args.model, "context": args.context, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".md").write_text(f"{result['machine']}, {args.model}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
