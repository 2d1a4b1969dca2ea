"""The GPU check: one command that proves and times specjax on an NVIDIA GPU.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out DIR      # on a GPU: every section, ~8 min (H100)
    python benchmarks/gpu_check.py --smoke --out DIR            # on CPU, tiny shapes (tests run it)
    python benchmarks/gpu_check.py --lower-only [--tp N]        # on CPU: lower every GPU program for CUDA

Sections (each written to DIR/results.json and DIR/results.md as soon as it ends, so a run cut
short keeps what it measured; a section that fails records its error and the run goes on):
- environment: versions, device, compute capability, memory, measured copy bandwidth;
- kernel: the Pallas kernel against the XLA reference on the test suite's random cases;
- methods: a tiny random model decoding greedily with every method, kernel on and off, tokens
  identical to vanilla decoding;
- sampling: a chi-square test of the first sampled token of a tree method against the target;
- speed (Llama-3-8B shape, random bfloat16 weights made on the device): prefill, vanilla decode
  at batch 1 and 8 against the bandwidth roofline, verify cost by tree size (a few layers timed
  and scaled to the whole model), an oracle drafter at 2/3/4/6 accepted tokens per step,
  kernel vs reference attention bandwidth and a block-size sweep;
- peer: transformers' greedy `generate` on the same shapes and weights (static cache).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

# JAX would take 75% of the GPU's memory at its first allocation, leaving too little for the
# peer (transformers on the same GPU): allocate as needed instead.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import gpu_supports_kernel, use_attention_backend
from specjax.cache import PagedKVCache, init_pages
from specjax.draft_tree import chain
from specjax.generate import Engine
from specjax.kernels_pallas import tree_paged_attention, tree_paged_attention_reference
from specjax.kernels_pallas.random_cases import TOL, make_case, rel_err
from specjax.loading import Model
from specjax.model import causal_mask, forward, init_params
from specjax.model_config import ModelConfig
from specjax.spec_decode import StatelessProposer

LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
# The same head layout at a size interpret mode and a CPU run in seconds (--smoke).
SMOKE_8B = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
)
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
METHODS = (
    "vanilla",
    "draft",
    "pld",
    "suffix",
    "medusa",
    "eagle1",
    "eagle2",
    "eagle3",
    "redrafter",
    "lookahead",
    "dflash",
)
HEAD_METHODS = ("medusa", "eagle1", "eagle2", "eagle3", "redrafter", "dflash")
ORACLE_ACCEPTED = (2, 3, 4, 6)


# --------------------------------------------------------------------------- the report


class Report:
    """Sections' results, rewritten to results.json / results.md after every section."""

    def __init__(self, out: Path | None, mode: str, budget_s: float):
        self.out, self.t0, self.budget_s = out, time.perf_counter(), budget_s
        self.data = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
        self.failed: list[str] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    @contextlib.contextmanager
    def section(self, name: str):
        entry: dict = {}
        self.data["sections"][name] = entry
        t = time.perf_counter()
        print(f"== {name} ({self.left():.0f} s of the budget left)", flush=True)
        try:
            yield entry
        except Exception as e:  # one broken section must not cost the others' results
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            self.failed.append(name)
            print(f"   FAILED: {entry['error']}", flush=True)
        entry["seconds"] = round(time.perf_counter() - t, 1)
        if entry.get("ok") is False and name not in self.failed:
            self.failed.append(name)
        self.write()

    def wants(self, name: str, skip: set, min_left_s: float) -> bool:
        """Whether to run section `name`: not skipped, and time left in the budget (a section
        left out for time is recorded as such)."""
        if name in skip:
            return False
        if self.left() < min_left_s:
            self.data["sections"][name] = {"skipped": f"under {min_left_s:.0f} s of the budget left"}
            self.write()
            return False
        return True

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "results.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    """results.md: one heading per section, its scalars as a list and its rows as a table."""
    lines = [f"# specjax GPU check ({data['mode']}, {data['date']})", ""]
    for name, entry in data["sections"].items():
        lines += [f"## {name}", ""]
        for k, v in entry.items():
            if k in ("rows", "traceback"):
                continue
            lines.append(f"- {k}: {v}")
        rows = entry.get("rows") or []
        if rows:
            cols = list(dict.fromkeys(c for r in rows for c in r))
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def best_time(fn, *args, repeat: int = 5) -> float:
    """Fastest of `repeat` timed calls (seconds), after one untimed call that compiles."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def device_seconds(step, carry, reps: int) -> float:
    """Seconds per `step(carry) -> carry` on the device: `reps` steps inside one program (each
    depends on the last, so none is hoisted or skipped), best of three runs after a compile. A
    call timed alone would also count its dispatch and the sync, tens of microseconds on a GPU:
    more than a decode step's attention takes."""
    many = jax.jit(lambda c: jax.lax.fori_loop(0, reps, lambda _, x: step(x), c))
    return best_time(many, carry, repeat=3) / reps


def attention_seconds(fn, args, reps: int) -> float:
    """Seconds per attention call `fn(q, *rest)` on the device (`device_seconds`); q feeds on
    the last output times a zero the compiler cannot see, a few kilobytes of extra work."""

    def step(carry):  # every array rides in the carry: one a closure captured would be a constant
        q, zero, rest = carry
        return q + zero * fn(q, *rest).astype(q.dtype), zero, rest

    return device_seconds(step, (args[0], jnp.zeros((), args[0].dtype), tuple(args[1:])), reps)


# --------------------------------------------------------------------------- environment


def environment(entry: dict, smoke: bool) -> float:
    """Versions and device facts, and the device's copy bandwidth (bytes/s), which is returned."""
    import jaxlib

    dev = jax.devices()[0]
    entry.update(
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        devices=jax.device_count(),
        device=getattr(dev, "device_kind", str(dev)),
        compute_capability=getattr(dev, "compute_capability", None),
    )
    with contextlib.suppress(Exception):
        entry["memory_gib"] = round(dev.memory_stats()["bytes_limit"] / 2**30, 1)
    n = (16 if smoke else 4096) * 2**20 // 4
    x = jnp.ones((n + 128,), jnp.float32)
    reps = 2 if smoke else 20
    copy = 2 * x.nbytes / device_seconds(lambda a: a * 0.5 + 1, x, reps)  # reads and writes every byte

    def read_step(carry):  # reads n floats at an offset that moves (nothing to hoist or fold)
        i, c, a = carry
        return i + 1, c + jnp.max(jax.lax.dynamic_slice(a, ((i % 2) * 128,), (n,))) * 1e-30, a

    read = 4 * n / device_seconds(read_step, (jnp.int32(0), jnp.float32(0), x), reps)
    entry["copy_bandwidth_gb_s"] = round(copy / 1e9, 1)
    entry["read_bandwidth_gb_s"] = round(read / 1e9, 1)
    entry["roofline_bandwidth"] = "the larger of the two (a decode step only reads)"
    return max(copy, read)


# --------------------------------------------------------------------------- correctness


def kernel_correctness(
    entry: dict, interpret: bool, smoke: bool, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16)
) -> None:
    """The kernel against the XLA reference over the suite's random cases (NaN in every slot no
    query reads, random trees, ragged lengths), each dtype, GQA ratio, page size and tree size."""
    grid = [(dt, t, g) for dt in dtypes for t in (1, 5, 26, 64) for g in (1, 4, 8)]
    if smoke:
        grid = [(jnp.float32, 5, 4), (jnp.bfloat16, 1, 1)]
    rows, worst = [], {}
    reference = jax.jit(tree_paged_attention_reference)
    for i, (dt, t, g) in enumerate(grid):
        ps = (16, 64)[i % 2]
        for window in (None, 24) if t == 5 else (None,):
            args, key_mask = make_case(i, t=t, g=g, ps=ps, kvh=2 if g < 8 else 1, dtype=dt, window=window)
            out = tree_paged_attention(*args, key_mask=key_mask, interpret=interpret)
            ref = reference(*args, key_mask=key_mask)
            err = rel_err(out, ref)
            name = jnp.dtype(dt).name
            worst[name] = max(worst.get(name, 0.0), err)
            if not err <= TOL[dt]:
                rows.append(
                    {
                        "dtype": name,
                        "T": t,
                        "G": g,
                        "page_size": ps,
                        "window": window,
                        "rel_err": f"{err:.2e}",
                        "tolerance": TOL[dt],
                    }
                )
    entry.update(
        cases=sum(2 if t == 5 else 1 for _, t, _ in grid),
        failures=len(rows),
        worst_rel_err={k: f"{v:.1e}" for k, v in worst.items()},
        ok=not rows,
        rows=rows,
    )


def tiny_target(key: int = 1, dtype=jnp.float32):
    """A tiny random model as a `Model` (its head checkpoints go to a temporary dir)."""
    params = init_params(TINY, jax.random.PRNGKey(key), dtype, scale=0.5)
    return Model(params, TINY, Path(tempfile.mkdtemp(prefix="gpu-check-")), TINY.to_hf())


def method_proposer(method: str, target: Model):
    """(proposer, params) of `method` for the tiny target: random heads through their real
    checkpoint loaders, a one-layer self-draft, a small Lookahead window."""
    from specjax.methods import HEAD_KINDS, make_proposer
    from specjax.random_heads import random_head_checkpoint

    if method in HEAD_METHODS:
        kind = HEAD_KINDS[method]
        heads = target.path / kind
        if not heads.exists():
            random_head_checkpoint(kind, target, heads)
        options = (
            {"eagle_total_tokens": 10, "eagle_depth": 3, "eagle_top_k": 3} if method in ("eagle2", "eagle3") else {}
        )
        return make_proposer(method, target, heads=str(heads), **options)
    if method == "draft":
        return make_proposer("draft", target, draft_layers=1, max_draft_len=3)
    if method == "pld":
        return make_proposer("pld", target, prompt_lookup_num_tokens=4, max_matching_ngram_size=2)
    if method == "lookahead":
        return make_proposer("lookahead", target, lookahead=(3, 3, 3))
    return make_proposer(method, target)


PROMPTS = [[3, 9, 27, 17, 51, 25, 11, 33, 35, 41, 7, 7, 2, 60, 31, 18, 19, 40, 3, 9, 27], [5, 5, 5, 6, 5, 5], [1, 2]]


def method_correctness(entry: dict, kernel_backend: str, methods, kernel_methods, new_tokens: int) -> None:
    """Greedy tokens of every method with the kernel off (XLA reference) and on, against vanilla."""
    target = tiny_target()
    rows, ok = [], True
    want = None
    for backend in ("xla", kernel_backend):
        with use_attention_backend(backend):
            engine = Engine(target.params, TINY, num_pages=96, page_size=16)
            for method in methods if backend == "xla" else kernel_methods:
                proposer, pparams = method_proposer(method, target)
                out = engine.generate(PROMPTS, new_tokens, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
                if want is None:
                    want = out.token_ids
                same = out.token_ids == want
                ok &= same
                rows.append(
                    {
                        "backend": backend,
                        "method": method,
                        "identical_to_vanilla": same,
                        "tokens_per_step": round(sum(map(len, out.token_ids)) / max(1, sum(out.steps)), 2),
                    }
                )
    entry.update(ok=ok, rows=rows)


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value): cells expecting fewer than 5 draws are pooled;
    the p-value by the Wilson-Hilferty normal approximation of the chi-square tail."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return stat, k, 0.5 * math.erfc(z / math.sqrt(2))


def sampling_check(entry: dict, samples: int, kernel_backend: str) -> None:
    """First sampled token of EAGLE-2 (random heads, temperature 1) against the target's own
    distribution at the prompt: a chi-square test; lossless sampling must pass it."""
    from specjax.sampling import SamplingConfig

    target = tiny_target()
    prompt = PROMPTS[0]
    with use_attention_backend(kernel_backend):
        engine = Engine(target.params, TINY, num_pages=samples * 4 + 16, page_size=16)
        proposer, pparams = method_proposer("eagle2", target)
        out = engine.generate(
            [prompt] * samples,
            2,
            sampling=SamplingConfig(temperature=1.0),
            seeds=list(range(samples)),
            eos_token_ids=(),
            proposer=proposer,
            proposer_params=pparams,
            fixed_speculation=True,  # every step verifies the whole tree: the rule is what is tested
        )
        k, v = init_pages(TINY, 4, 32, jnp.float32)
        cache = PagedKVCache(k, v, jnp.arange(2, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32))
        n = len(prompt)
        logits = forward(
            target.params, TINY, jnp.asarray([prompt]), jnp.arange(n)[None], cache, causal_mask(1, n)
        ).logits[0, -1]
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)), np.float64)
    first = np.bincount([ids[0] for ids in out.token_ids], minlength=TINY.vocab_size)
    stat, dof, p = chi_square_p(first.astype(np.float64), probs * samples)
    entry.update(samples=samples, chi2=round(stat, 1), dof=dof, p_value=f"{p:.3g}", ok=p > 1e-3)


# --------------------------------------------------------------------------- speed


def chained_params(cfg: ModelConfig, key, dtype=jnp.bfloat16) -> dict:
    """Random weights of `cfg`'s shape whose greedy decoding follows a fixed random permutation of
    the vocabulary by a wide margin: the layers' output projections are scaled down so that the
    last hidden state is about the current token's embedding, and `lm_head` row perm[c] is
    embedding row c. With plain random weights, logits are near-ties that bfloat16 rounding
    breaks differently in a one-token step and in a tree pass, so two correct runs part after a
    few tokens (and the oracle drafter, whose drafts come from one run, stops being accepted).
    The time of every step is the same as with any other weights of the shape."""
    params = init_params(cfg, key, dtype)
    perm = jax.random.permutation(jax.random.fold_in(key, 1), cfg.vocab_size)
    params["layers"] = [
        {**layer, "wo": layer["wo"] * 1e-3, "w_down": layer["w_down"] * 1e-3} for layer in params["layers"]
    ]
    params["lm_head"] = params["embed"][jnp.argsort(perm)]
    return params


def random_tokens(rng, b: int, n: int, vocab: int) -> list[list[int]]:
    return rng.integers(0, vocab, size=(b, n)).tolist()


def decode_speed(entry: dict, params, cfg: ModelConfig, bandwidth: float, smoke: bool) -> None:
    """Vanilla decode at batch 1 and 8 (context ~1k) against the roofline (every step reads all
    weights and each sequence's K/V once), and the prefill of those prompts; best of two runs."""
    rng = np.random.default_rng(0)
    ctx, new = (64, 8) if smoke else (1024, 128)
    engine = Engine(params, cfg, num_pages=(64 if smoke else 1024), page_size=16)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    entry["weight_gb"] = round(weight_bytes / 1e9, 2)
    rows = []
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    for b in (1, 8):
        engine.generate(random_tokens(rng, b, ctx, cfg.vocab_size), new, eos_token_ids=(), warmup=True)
        runs = [engine.generate(random_tokens(rng, b, ctx, cfg.vocab_size), new, eos_token_ids=()) for _ in range(2)]
        out = min(runs, key=lambda o: o.seconds - o.prefill_seconds)
        seconds = out.seconds - out.prefill_seconds
        prefill = min(o.prefill_seconds for o in runs)
        tps = b * new / seconds
        step_bytes = weight_bytes + b * (ctx + new / 2) * kv_bytes_per_token
        roofline = b * bandwidth / step_bytes
        rows.append(
            {
                "batch": b,
                "context": ctx,
                "new_tokens": new,
                "tokens_per_s": round(tps, 1),
                "ms_per_step": round(1e3 * seconds / new, 2),
                "roofline_tokens_per_s": round(roofline, 1),
                "fraction_of_roofline": round(tps / roofline, 3),
                "prefill_tokens_per_s": round(b * ctx / prefill),
            }
        )
    entry["rows"] = rows


def verify_cost(entry: dict, params, cfg: ModelConfig, smoke: bool) -> None:
    """Cost of one whole-model target pass over T tree nodes relative to T = 1, at context ~1k:
    one compile per T (about 10 s each for the 8B shape on an H100/H200), the fastest of five
    calls (a call's dispatch, ~0.1 ms, is ~2% of a pass).

    (A first version timed 2- and 4-layer passes and extrapolated to 32 layers: on the H200 the
    difference of two short timings was noise, T = 4 came out dearer than T = 16.)"""
    ctx = 64 if smoke else 1024
    sizes = (1, 4, 8) if smoke else (1, 8, 16, 32, 64)
    pages = -(-(ctx + max(sizes)) // 16)
    k, v = init_pages(cfg, pages + 1, 16, params["embed"].dtype)
    cache = PagedKVCache(k, v, jnp.arange(pages, dtype=jnp.int32)[None], jnp.full((1,), ctx, jnp.int32))
    fn = jax.jit(lambda p, c, tok, mask: forward(p, cfg, tok, ctx + jnp.arange(tok.shape[1])[None], c, mask).logits)
    rows = []
    for t in sizes:
        tok = jnp.zeros((1, t), jnp.int32)
        rows.append({"T": t, "ms": round(1e3 * best_time(fn, params, cache, tok, causal_mask(1, t)), 2)})
    for r in rows:
        r["relative_to_T1"] = round(r["ms"] / rows[0]["ms"], 3)
    entry.update(method=f"whole model ({cfg.num_layers} layers), context {ctx}, best of 5 calls", rows=rows)


@dataclasses.dataclass(frozen=True)
class OracleProposer(StatelessProposer):
    """Drafts the target's own greedy continuation (known from a vanilla run): a chain of
    `params["count"]` tokens read from `params["reference"]` at the sequence's length, so every
    step accepts count + 1 tokens. It measures what the speculative machinery costs, apart from
    any drafter's quality."""

    max_draft: int
    rule: str = "match"
    is_chain: bool = True

    @property
    def tree_size(self) -> int:
        return self.max_draft + 1

    def propose(self, params, state, ctx, keys, sampling):
        ref = params["reference"]
        b, width = ref.shape
        idx = jnp.clip(ctx.lengths[:, None] + jnp.arange(self.max_draft)[None], 0, width - 1)
        drafts = jnp.take_along_axis(ref, idx, axis=1)
        count = jnp.clip(jnp.minimum(params["count"], width - ctx.lengths), 0, self.max_draft)
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        return chain(pending, drafts, count), state


def oracle_speedups(entry: dict, params, cfg: ModelConfig, smoke: bool) -> None:
    """End-to-end speedup over vanilla decoding (batch 1, same prompt) with the oracle drafter
    at 2, 3, 4 and 6 accepted tokens per step; one compile serves every count (new tokens a
    multiple of each, so every step accepts exactly that many)."""
    ctx, new = (64, 24) if smoke else (1024, 120)
    rng = np.random.default_rng(1)
    prompt = random_tokens(rng, 1, ctx, cfg.vocab_size)
    engine = Engine(params, cfg, num_pages=(64 if smoke else 256), page_size=16)
    ref = engine.generate(prompt, new + 8, eos_token_ids=())
    engine.generate(prompt, new, eos_token_ids=(), warmup=True)  # compiled before it is timed
    vanilla_out = engine.generate(prompt, new, eos_token_ids=())
    seconds_vanilla = vanilla_out.seconds - vanilla_out.prefill_seconds
    reference = jnp.asarray([prompt[0] + ref.token_ids[0]], jnp.int32)
    proposer = OracleProposer(max(ORACLE_ACCEPTED) - 1)
    rows = []
    for accepted in ORACLE_ACCEPTED:
        pparams = {"reference": reference, "count": jnp.int32(accepted - 1)}
        kw = dict(eos_token_ids=(), proposer=proposer, proposer_params=pparams, fixed_speculation=True)  # forced
        engine.generate(prompt, new, warmup=True, **kw)
        out = engine.generate(prompt, new, **kw)
        seconds = out.seconds - out.prefill_seconds
        rows.append(
            {
                "accepted_per_step": accepted,
                "measured_tokens_per_step": round(new / out.steps[0], 2),
                "tokens_per_s": round(new / seconds, 1),
                "speedup": round(seconds_vanilla / seconds, 2),
                "same_tokens_as_vanilla": out.token_ids == vanilla_out.token_ids,
            }
        )
    entry.update(
        vanilla_tokens_per_s=round(new / seconds_vanilla, 1),
        rows=rows,
        ok=all(r["same_tokens_as_vanilla"] and r["measured_tokens_per_step"] == r["accepted_per_step"] for r in rows),
    )


def attention_bandwidth(entry: dict, bandwidth: float, smoke: bool, interpret: bool) -> None:
    """Pallas kernel vs XLA reference: time and achieved bandwidth (K/V bytes read / time) at
    the 8B model's heads."""
    kvh, d = (2, 32) if smoke else (8, 128)
    contexts, batches, trees = ((64,), (1, 2), (1, 8)) if smoke else ((2048, 8192), (1, 8, 32), (1, 8, 64))
    rows = []
    reps = 2 if smoke else 50
    for context in contexts:
        for b in batches:
            for t in trees:
                args = attention_inputs(b, t, context, smoke)
                kv_bytes = 2 * b * context * kvh * d * 2
                kernel = functools.partial(tree_paged_attention, interpret=interpret)
                tk = attention_seconds(kernel, args, reps)
                tr = attention_seconds(tree_paged_attention_reference, args, reps)
                rows.append(
                    {
                        "context": context,
                        "B": b,
                        "T": t,
                        "kernel_us": round(1e6 * tk, 1),
                        "reference_us": round(1e6 * tr, 1),
                        "kernel_vs_reference": round(tr / tk, 2),
                        "kernel_gb_s": round(kv_bytes / tk / 1e9, 1),
                        "fraction_of_bandwidth": round(kv_bytes / tk / bandwidth, 3),
                    }
                )
    entry["rows"] = rows


def attention_inputs(b: int, t: int, context: int, smoke: bool):
    """Kernel arguments at the 8B model's heads: random bfloat16 q and K/V pages, every sequence
    `context` keys long, a causal tree of `t` nodes."""
    h, kvh, d, ps = (4, 2, 32, 16) if smoke else (32, 8, 128, 16)
    n = -(-(context + t) // ps)
    key = jax.random.PRNGKey(b * 1000 + t)
    q = jax.random.normal(key, (b, t, h, d), jnp.bfloat16)
    kv = jax.random.normal(key, (kvh, b * n + 1, ps, d), jnp.bfloat16)
    tables = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    lengths = jnp.full((b,), context, jnp.int32)
    return (q, kv, kv, tables, lengths, causal_mask(b, t))


def block_sweep(entry: dict, smoke: bool, interpret: bool) -> None:
    """Kernel time per tile setting at decode and tree shapes (the table the tile defaults are
    chosen from), at the longest context of the attention section."""
    context = 64 if smoke else 8192
    inputs = functools.partial(attention_inputs, smoke=smoke)
    shapes = ((1, 1), (2, 8)) if smoke else ((1, 1), (32, 1), (8, 64), (1, 64))
    settings = [dict(block_k=bk, num_warps=w) for bk in (32, 64, 128) for w in (4, 8)]
    settings += [dict(k_splits=s) for s in (1, 4, 16)]
    if smoke:
        settings = settings[:2]
    out = []
    for b, t in shapes:
        args = inputs(b, t, context)
        for s in settings:
            fn = functools.partial(tree_paged_attention, interpret=interpret, **s)
            try:
                us = round(1e6 * attention_seconds(fn, args, 2 if smoke else 50), 1)
            except Exception as e:  # a setting Triton cannot compile is a row, not a failure
                us = f"{type(e).__name__}"
            out.append({"B": b, "T": t, "context": context, **s, "us": us})
    entry["rows"] = out


def peer_transformers(entry: dict, params, cfg: ModelConfig, ours_tps: float, smoke: bool) -> None:
    """transformers' greedy `generate` (eager, static cache) on the same weights and shapes, at
    batch 1, context ~1k."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}[params["embed"].dtype]
    hf = LlamaConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf).eval()
    finally:
        torch.set_default_dtype(default)
    model.tie_weights()
    expected = {n for n, _ in model.named_parameters()}
    copied = set()
    with torch.no_grad():
        for name, arr in hf_tensors(params, cfg):  # one tensor at a time: no second model in memory
            model.get_parameter(name).copy_(to_torch(arr, device))
            copied.add(name)
    if expected - copied:
        raise RuntimeError(f"weights missing for transformers' Llama: {sorted(expected - copied)[:3]}")
    ctx, new = (64, 8) if smoke else (1024, 128)
    ids = torch.tensor(random_tokens(np.random.default_rng(2), 1, ctx, cfg.vocab_size), device=device)
    # token 0 as EOS, held off by min_new_tokens: every run generates exactly n tokens
    # eager: transformers >= 4.48 would torch.compile the forward of a static cache
    kwargs = dict(do_sample=False, cache_implementation="static", eos_token_id=0, pad_token_id=0, disable_compile=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        times = {}
        for n in (1, new, 1, new):  # the difference removes prefill from the decode time
            sync()
            t = time.perf_counter()
            model.generate(ids, **{**kwargs, "max_new_tokens": n, "min_new_tokens": n})
            sync()
            times[n] = min(times.get(n, math.inf), time.perf_counter() - t)
        theirs = model.generate(ids, **{**kwargs, "max_new_tokens": 16, "min_new_tokens": 16})[0, ctx:].tolist()
    tps = (new - 1) / (times[new] - times[1])
    ours = (
        Engine(params, cfg, num_pages=(64 if smoke else 256), page_size=16)
        .generate(ids.tolist(), 16, eos_token_ids=())
        .token_ids[0]
    )
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 16)
    entry.update(greedy_tokens_agreeing=f"{agree} of 16", ok=agree == 16)
    entry.update(
        peer=f"transformers {__import__('transformers').__version__} eager, static cache",
        torch=torch.__version__,
        tokens_per_s=round(tps, 1),
        ours_tokens_per_s=ours_tps,
        ours_vs_peer=round(ours_tps / tps, 2),
    )


def hf_tensors(params, cfg: ModelConfig):
    """(Hugging Face name, device array) pairs of specjax parameters (fused weights split)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    yield "model.embed_tokens.weight", params["embed"]
    yield "model.norm.weight", params["norm"]
    if "lm_head" in params:
        yield "lm_head.weight", params["lm_head"]
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        w = layer["wqkv"]
        yield from (
            (p + "self_attn.q_proj.weight", w[:q]),
            (p + "self_attn.k_proj.weight", w[q : q + kv]),
            (p + "self_attn.v_proj.weight", w[q + kv :]),
            (p + "self_attn.o_proj.weight", layer["wo"]),
            (p + "input_layernorm.weight", layer["attn_norm"]),
            (p + "post_attention_layernorm.weight", layer["mlp_norm"]),
            (p + "mlp.gate_proj.weight", layer["w_gate_up"][: cfg.intermediate_size]),
            (p + "mlp.up_proj.weight", layer["w_gate_up"][cfg.intermediate_size :]),
            (p + "mlp.down_proj.weight", layer["w_down"]),
        )


def to_torch(arr, device: str):
    """A JAX array as a torch tensor on `device` (through DLPack on the GPU: no host copy)."""
    import torch

    if device == "cuda":
        return torch.from_dlpack(jnp.array(arr, copy=True)).clone()
    return torch.from_numpy(np.array(arr.astype(jnp.float32))).to(
        torch.bfloat16 if arr.dtype == jnp.bfloat16 else torch.float32
    )


# --------------------------------------------------------------------------- lowering


TRITON = "__gpu$xla.gpu.triton"
# Programs that must hold the kernel: every target pass attends over the paged cache.
ATTENDING = ("prefill", "decode_loop", "spec_loop", "advance")


def lower_programs(tp: int, dp: int = 1, methods=METHODS):
    """(program name, Triton calls, problem or None) for every program a GPU run compiles.

    The engine runs each method for two tokens on this machine with the XLA reference, and each
    jitted program it calls is also exported for CUDA with the kernel forced on (jax.export
    needs only the arguments' shapes, which the real calls provide)."""
    from jax import export

    from specjax.sharding import make_mesh

    target = tiny_target()
    mesh = make_mesh(tp=tp, dp=dp) if tp * dp > 1 else None
    local_kv_heads = TINY.num_kv_heads // tp
    seen: dict[str, tuple[int, str | None]] = {}

    def exporting(fn, name):
        def run(*args, **kwargs):
            label = f"{name}[{method}]" if name in ("spec_loop", "init_proposer", "advance") else name
            if label not in seen:
                jitted, bound = fn, {}
                if isinstance(fn, functools.partial):  # the mesh's engine functions bind the mesh
                    jitted, bound = fn.func, fn.keywords
                with use_attention_backend("pallas"):
                    exp = export.export(
                        jitted, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)]
                    )(*args, **bound, **kwargs)
                seen[label] = triton_calls(exp.mlir_module(), TINY, local_kv_heads)
                calls, problem = seen[label]
                if problem is None and calls == 0 and name in ATTENDING:
                    seen[label] = (0, "no Pallas/Triton kernel in a program that attends")
            return fn(*args, **kwargs)

        return run

    with use_attention_backend("xla"):
        engine = Engine(target.params, TINY, num_pages=64, page_size=16, mesh=mesh)
        names = ("prefill", "decode_loop", "spec_loop", "init_proposer", "advance")
        engine._fns = tuple(exporting(f, n) for f, n in zip(engine._fns, names))
        for method in methods:
            proposer, pparams = method_proposer(method, target)
            for fixed in (True, False):  # spec_loop, then the budget's segments (`advance`)
                engine.generate(
                    PROMPTS[:2],
                    2,
                    eos_token_ids=(),
                    proposer=proposer,
                    proposer_params=pparams,
                    fixed_speculation=fixed,
                )
    return [(name, calls, problem) for name, (calls, problem) in seen.items()]


def triton_calls(
    module_text: str, cfg: ModelConfig, local_kv_heads: int, page_size: int = 16
) -> tuple[int, str | None]:
    """(number of Triton custom calls, problem): the KV pools a call reads ([KVH, pages,
    page_size, head_dim] operands) must hold the device's own KV heads (the kernel inside
    shard_map), not every head gathered onto each device."""
    import re

    calls = [line for line in module_text.splitlines() if TRITON in line and "custom_call" in line]
    operands = [line.rsplit(" : (", 1)[-1].split(") ->")[0] for line in calls]  # not the result
    shapes = [
        tuple(int(x) for x in m.split("x")[:-1])
        for ops in operands
        for m in re.findall(r"tensor<([0-9x]+x(?:bf16|f16|f32))>", ops)
    ]
    heads = {s[0] for s in shapes if len(s) == 4 and s[2:] == (page_size, cfg.head_dim)}
    if heads - {local_kv_heads}:
        return len(calls), (
            f"the kernel reads {max(heads)} KV heads on each device, not its own {local_kv_heads} (outside shard_map)"
        )
    return len(calls), None


def lower_only(tp: int, dp: int = 1, methods=METHODS) -> int:
    """Lower every program a GPU run compiles for CUDA (jax.export on this machine) with the
    kernel forced on; one line per program with its Triton custom calls. Exit status 1 when a
    program that attends has none, or (tp > 1) when a kernel reads every KV head on each device."""
    if jax.device_count() < tp * dp:
        print(
            f"gpu_check: --tp {tp} --dp {dp} needs {tp * dp} devices; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * dp}",
            file=sys.stderr,
        )
        return 2
    failures = 0
    for name, calls, problem in lower_programs(tp, dp, methods):
        status = "ok" if problem is None else f"FAIL: {problem}"
        print(f"tp={tp} dp={dp} {name:<28} triton calls: {calls:>3}  {status}", flush=True)
        failures += problem is not None
    return 1 if failures else 0


# --------------------------------------------------------------------------- main


# Sections in the order they run, each with the budget it must have left to start on a GPU
# (about its time on an H100/H200, compiles included).
SECTIONS = {
    "environment": 0,
    "kernel": 30,
    "methods": 60,
    "sampling": 20,
    "decode": 90,
    "peer": 45,
    "oracle": 50,
    "verify": 60,
    "attention": 40,
    "tiles": 30,
}
CORRECTNESS = ("kernel", "methods", "sampling")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    ap.add_argument("--smoke", action="store_true", help="every section at tiny shapes, on any device")
    ap.add_argument("--lower-only", action="store_true", help="lower every GPU program for CUDA, run nothing")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size for --lower-only")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size for --lower-only")
    ap.add_argument("--methods", default=",".join(METHODS), help="methods --lower-only lowers")
    ap.add_argument("--budget-s", type=float, default=450, help="stop starting sections after this")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    args = ap.parse_args(argv)
    if args.lower_only:
        return lower_only(args.tp, args.dp, tuple(args.methods.split(",")))
    if not args.smoke and not gpu_supports_kernel():
        print(
            f"gpu_check: no CUDA GPU of compute capability >= 8.0 here (backend "
            f"{jax.default_backend()}); use --smoke or --lower-only",
            file=sys.stderr,
        )
        return 2
    wanted = set(filter(None, args.only.split(","))) - set(filter(None, args.skip.split(",")))
    if unknown := wanted - set(SECTIONS):
        print(f"gpu_check: unknown sections {sorted(unknown)}; the sections are {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    smoke = args.smoke
    report = Report(args.out, "smoke" if smoke else "gpu", args.budget_s)
    kernel_backend = "pallas-interpret" if smoke else "pallas"
    interpret = smoke

    def wants(name: str) -> bool:  # smoke runs every wanted section, whatever the budget
        return name in wanted and report.wants(name, set(), -1e9 if smoke else SECTIONS[name])

    bandwidth = None
    if wants("environment"):
        with report.section("environment") as e:
            bandwidth = environment(e, smoke)
    if wants("kernel"):
        with report.section("kernel") as e:
            kernel_correctness(e, interpret, smoke)
    if wants("methods"):
        with report.section("methods") as e:
            kernel_methods = ("vanilla",) if smoke else METHODS
            method_correctness(e, kernel_backend, METHODS, kernel_methods, 8 if smoke else 16)
    if wants("sampling"):
        with report.section("sampling") as e:
            sampling_check(e, 400 if smoke else 4000, kernel_backend)
    if bandwidth is None and wanted & {"decode", "attention"}:
        print("gpu_check: decode and attention need the environment section's bandwidth", file=sys.stderr)
        return 2
    cfg = SMOKE_8B if smoke else LLAMA3_8B
    with use_attention_backend(kernel_backend):
        params = None
        if wanted & {"decode", "peer", "oracle", "verify"}:
            params = chained_params(cfg, jax.random.PRNGKey(0))
        if wants("decode"):
            with report.section("decode") as e:
                decode_speed(e, params, cfg, bandwidth, smoke)
        if "rows" in report.data["sections"].get("decode", {}) and wants("peer"):
            with report.section("peer") as e:
                ours = report.data["sections"]["decode"]["rows"][0]["tokens_per_s"]
                peer_transformers(e, params, cfg, ours, smoke)
        if wants("oracle"):
            with report.section("oracle") as e:
                oracle_speedups(e, params, cfg, smoke)
        if wants("verify"):
            with report.section("verify") as e:
                verify_cost(e, params, cfg, smoke)
        if wants("attention"):
            with report.section("attention") as e:
                attention_bandwidth(e, bandwidth, smoke, interpret)
        if wants("tiles"):
            with report.section("tiles") as e:
                block_sweep(e, smoke, interpret)
    summary = ", ".join(f"{k}: {'FAILED' if k in report.failed else 'ok'}" for k in report.data["sections"])
    print(f"gpu_check done in {time.perf_counter() - report.t0:.0f} s: {summary}", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
