"""What the global cache of suffix decoding costs, by cached tokens: one drafting step (the
whole `suffix_tree`, the rows' own text included) with the sorted-hash index
(`specjax.proposers.suffix_cache`) against a vectorized scan of the whole cache (the other
device-resident design), and the host's cost to add a request's output and upload the index.

    python benchmarks/bench_suffix_cache.py --sizes 1000,100000,1000000 --batches 1,16

Each cache is filled with 256-token texts drawn so that n-grams repeat (a 2k-token vocabulary
of a Zipf law). Step times are the least of `--repeat` runs of 20 steps inside one jitted
loop. The scan is timed up to 2M cached tokens x rows (linear past them). Also lowers the
indexed step for CUDA with jax.export (the program a GPU would run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench import machine
from specjax.proposers.suffix import suffix_tree
from specjax.proposers.suffix_cache import SEPARATOR, SuffixCache

OPTIONS = dict(
    max_nodes=9,
    max_match=8,
    max_occurrences=32,
    max_tree_depth=24,
    max_spec_factor=1.0,
    max_spec_offset=0.0,
    min_token_prob=0.1,
)
CONTEXT = 1024  # each row's own text (prompt and output so far)


def scan_tree(text, written, tokens, length, count=32):
    """The draft tree with the cache searched by a scan of every cached position: the most
    recent `count` positions whose last m tokens match, per m (the alternative design)."""
    m_max, d = OPTIONS["max_match"], OPTIONS["max_nodes"] - 1
    c = text.shape[0]
    b = tokens.shape[0]
    k = jnp.arange(m_max)
    last = tokens[jnp.arange(b)[:, None], jnp.maximum(length[:, None] - 1 - k, 0)]  # [B, M]
    run = jnp.ones((b, c), bool)
    conts, knowns = [], []
    pos = jnp.arange(c)
    for m in range(m_max):
        run = run & (jnp.roll(text, m)[None, :] == last[:, m : m + 1])
        score = jnp.where(run & (pos < jnp.minimum(written, c) - 1)[None, :], pos + 1, 0)
        hits, ends = jax.lax.top_k(score, count)
        at = ends[..., None] + 1 + jnp.arange(d)
        cont = text[jnp.mod(at, c)]
        conts.append(cont)
        knowns.append((hits > 0)[..., None] & (jnp.cumprod(cont != SEPARATOR, axis=-1) > 0))
    return suffix_tree(tokens, length, **OPTIONS, extra=(jnp.stack(conts), jnp.stack(knowns)))


def filled_cache(tokens: int, rng) -> SuffixCache:
    cache = SuffixCache(OPTIONS["max_match"], max(tokens, 2))
    ranks = np.arange(1, 2049)
    p = 1 / ranks
    p /= p.sum()
    while cache.written < tokens:
        cache.add(rng.choice(2048, size=256, p=p))
    return cache


def time_steps(step, args, repeat: int) -> float:
    """ms per step: 20 steps inside one jitted loop, the least of `repeat` runs."""

    def loop(tokens, length, *rest):
        def body(i, acc):  # each step reads another position: nothing is hoisted out of the loop
            tree = step(tokens, length - i % 8, *rest)
            return acc + tree.tokens[:, 1].sum()

        return jax.lax.fori_loop(0, 20, body, jnp.int32(0))

    f = jax.jit(loop)
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best / 20 * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-scan", action="store_true", help="time the index alone")
    ap.add_argument("--out", default="benchmarks/results/suffix_cache_cost")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        cache = filled_cache(size, rng)
        t0 = time.perf_counter()
        cache.add(rng.integers(0, 2048, 256))
        add_ms = (time.perf_counter() - t0) * 1e3
        jax.block_until_ready(cache.index)
        cache._device = None  # the second build: no first-call overheads
        t0 = time.perf_counter()
        jax.block_until_ready(cache.index)
        upload_ms = (time.perf_counter() - t0) * 1e3
        index = cache.index
        for b in (int(x) for x in args.batches.split(",")):
            tokens = jnp.asarray(rng.integers(0, 2048, (b, CONTEXT)), jnp.int32)
            length = jnp.full((b,), CONTEXT - 8, jnp.int32)
            own = time_steps(lambda t, n: suffix_tree(t, n, **OPTIONS), (tokens, length), args.repeat)
            indexed = time_steps(
                lambda t, n, i: suffix_tree(t, n, **OPTIONS, cache=i), (tokens, length, index), args.repeat
            )
            scan = None
            if not args.no_scan and size * b <= 2_000_000:  # past that a run takes minutes (linear)
                scan = time_steps(
                    lambda t, n, x, w: scan_tree(x, w, t, n), (tokens, length, index.text, index.written), args.repeat
                )
            row = dict(
                cached_tokens=size,
                batch=b,
                own_text_ms=own,
                index_ms=indexed,
                scan_ms=scan,
                add_ms=add_ms,
                upload_ms=upload_ms,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    from jax import export

    tokens = jnp.zeros((16, CONTEXT), jnp.int32)
    exp = export.export(jax.jit(lambda t, n, i: suffix_tree(t, n, **OPTIONS, cache=i)), platforms=["cuda"])(
        tokens, jnp.full((16,), 10, jnp.int32), filled_cache(1000, rng).index
    )
    lowered = len(exp.mlir_module()) > 0
    print("lowered for CUDA:", lowered)
    result = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "options": OPTIONS,
        "context": CONTEXT,
        "rows": rows,
        "lowered_for_cuda": lowered,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    head = ("cached tokens", "batch", "own text only", "+ index", "+ scan", "add 256 tokens", "upload")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{r['cached_tokens']:,}", str(r["batch"])]
        cells += ["-" if r[k] is None else f"{r[k]:.2f}" for k in ("own_text_ms", "index_ms", "scan_ms")]
        cells += [f"{r['add_ms']:.1f}", f"{r['upload_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nms per drafting step (columns 3-5) and per host update (columns 6-7).")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
