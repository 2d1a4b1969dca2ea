"""Decode time under the two samplers of `specjax.sampling.categorical`, side by side in one process.

On XLA:CPU a token is drawn by inverting the cumulative sum of its probabilities
(`inverse_cdf_draw`: two uniforms); elsewhere by the argmax of logits plus Gumbel noise
(`gumbel_max_draw`, jax.random.categorical's draw: one Gumbel sample per vocabulary entry).
Both draw from the same law but not the same tokens, so the two programs' steps differ in what
they accept; the figure to read is ms per decode step (vanilla: per token), with tokens per
step beside it. Each prompt runs under both samplers, in alternating order (`--rounds` times).

    python benchmarks/sampler_cost.py --methods vanilla,draft --temperature 1 --limit 1 --rounds 3
    python benchmarks/sampler_cost.py --methods pld --temperature 0.7 --top-k 50 --top-p 0.9
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_sampled_decoding_args

import specjax.sampling as sampling_mod
from specjax import Engine, SamplingConfig, load_model
from specjax.bench import read_bench_prompts
from specjax.compile_cache import enable_compile_cache
from specjax.methods import make_proposer
from specjax.prompts import encode_prompt

SAMPLERS = {"inverse_cdf": sampling_mod.inverse_cdf_draw, "gumbel_max": sampling_mod.gumbel_max_draw}


def one_draw_ms(vocab: int, calls: int = 2000) -> dict[str, float]:
    """ms per jitted draw from one row of `vocab` logits, under each sampler, alternating."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (1, vocab)) * 3
    keys = jax.random.split(jax.random.PRNGKey(1), 1)
    runs = {name: jax.jit(jax.vmap(draw)) for name, draw in SAMPLERS.items()}
    ms = dict.fromkeys(runs, 0.0)
    for _ in range(2):
        for name, run in runs.items():
            jax.block_until_ready(run(keys, logits))
            start = time.perf_counter()
            for _ in range(calls // 2):
                out = run(keys, logits)
            jax.block_until_ready(out)
            ms[name] += (time.perf_counter() - start) * 1e3 / calls
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="vanilla,eagle2", help="comma-separated")
    add_sampled_decoding_args(ap)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each prompt per sampler")
    ap.add_argument("--out", default=None, help="a JSON file for the totals")
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        ap.error("--temperature must be > 0: greedy decoding draws no samples")

    enable_compile_cache()  # each prompt traces both programs anew; compiling them is paid once
    model = load_model("smollm2-135m")
    draw_ms = one_draw_ms(model.config.vocab_size)
    print(
        "one draw from a row of the vocabulary: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in draw_ms.items()),
        flush=True,
    )
    methods = {m: (None, None) if m == "vanilla" else make_proposer(m, model) for m in args.methods.split(",")}
    engine = Engine(model.params, model.config, page_size=16, num_pages=200)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    prompts = read_bench_prompts(args.prompts, ["chat", "code", "math", "summarization"], args.limit)
    totals = {(m, s): {"seconds": 0.0, "steps": 0, "tokens": 0} for m in methods for s in SAMPLERS}
    for n, prompt in enumerate(prompts):
        ids = encode_prompt(model.tokenizer, prompt["text"], False)
        for method, (proposer, params) in methods.items():
            order = [name for r in range(args.rounds) for name in sorted(SAMPLERS, reverse=(n + r) % 2 == 1)]
            for name in order:
                sampling_mod.inverse_cdf_draw = SAMPLERS[name]  # what `categorical` calls on a CPU
                jax.clear_caches()  # trace anew under this sampler
                kw = dict(proposer=proposer, proposer_params=params, sampling=sampling, seeds=[n])
                engine.allocator.forget_prefixes()
                engine.generate([ids], args.max_new_tokens, warmup=True, **kw)
                out = engine.generate([ids], args.max_new_tokens, **kw)
                t = totals[method, name]
                t["seconds"] += out.seconds - out.prefill_seconds
                t["steps"] += out.steps[0]
                t["tokens"] += len(out.token_ids[0])
                print(
                    f"{n:3d} {prompt['category']:14s} {method:8s} {name:11s} {out.steps[0]} steps, "
                    f"{(out.seconds - out.prefill_seconds) / out.steps[0] * 1e3:.2f} ms per step",
                    flush=True,
                )
    sampling_mod.inverse_cdf_draw = SAMPLERS["inverse_cdf"]
    rows = []
    for (method, name), t in totals.items():
        rows.append(
            {
                "method": method,
                "sampler": name,
                "ms_per_step": t["seconds"] / t["steps"] * 1e3,
                "tokens_per_step": t["tokens"] / t["steps"],
                "steps": t["steps"],
            }
        )
        print(
            f"{method:8s} {name:11s} {rows[-1]['ms_per_step']:.2f} ms per decode step, "
            f"{rows[-1]['tokens_per_step']:.3f} tokens per step, over {t['steps']} steps"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "one_draw_ms": draw_ms, "rows": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
