"""Decode time of the two programs of the sampled acceptance walks, side by side in one process.

On XLA:CPU `recursive` and `traversal` skip, by conditionals, the vocabulary-sized work of the
nodes no row tries, `recursive` computes the target's p only at the nodes it accepts, and
`match` draws only at the nodes it reaches; the program traced for a GPU does that work for
every node (`specjax.accept._only_if`). Both give the same tokens
(tests/test_accept_recursive.py), so the decode steps are the same and their times differ by
the walk alone. Each prompt runs both programs, in alternating order.

    python benchmarks/accept_programs.py --temperature 1 --limit 5
    python benchmarks/accept_programs.py --temperature 0.7 --top-k 50 --top-p 0.9 --limit 5
    python benchmarks/accept_programs.py --method pld --temperature 0.7 --top-k 50 --top-p 0.9 --limit 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_sampled_decoding_args

import specjax.accept as accept_mod
from specjax import Engine, SamplingConfig, load_model
from specjax.bench import read_bench_prompts
from specjax.methods import make_proposer
from specjax.prompts import encode_prompt

PROGRAMS = {"cpu": True, "gpu": False}  # the value on_cpu_path() returns while tracing


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="eagle2")
    ap.add_argument("--option", action="append", default=[], help="KEY=VALUE for the proposer")
    add_sampled_decoding_args(ap)
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        ap.error("--temperature must be > 0: greedy decoding does not walk drawn trees")

    model = load_model("smollm2-135m")
    options = dict(kv.split("=", 1) for kv in args.option)
    proposer, params = make_proposer(args.method, model, **options)
    engine = Engine(model.params, model.config, page_size=16, num_pages=200)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    prompts = read_bench_prompts(args.prompts, ["chat", "code", "math", "summarization"], args.limit)
    seconds, steps = dict.fromkeys(PROGRAMS, 0.0), dict.fromkeys(PROGRAMS, 0)
    for n, prompt in enumerate(prompts):
        ids = encode_prompt(model.tokenizer, prompt["text"], False)
        tokens = {}
        for name in sorted(PROGRAMS, reverse=n % 2 == 1):
            accept_mod.on_cpu_path = lambda on_cpu=PROGRAMS[name]: on_cpu
            jax.clear_caches()  # trace anew under the program's choice
            kw = dict(proposer=proposer, proposer_params=params, sampling=sampling, seeds=[n])
            engine.allocator.forget_prefixes()
            engine.generate([ids], args.max_new_tokens, warmup=True, **kw)
            out = engine.generate([ids], args.max_new_tokens, **kw)
            seconds[name] += out.seconds - out.prefill_seconds
            steps[name] += out.steps[0]
            tokens[name] = list(out.token_ids[0])
            print(
                f"{n:3d} {prompt['category']:14s} {name} program: {out.steps[0]} steps, "
                f"{(out.seconds - out.prefill_seconds) / out.steps[0] * 1e3:.2f} ms per step",
                flush=True,
            )
        if tokens["cpu"] != tokens["gpu"]:
            sys.exit(f"prompt {n}: the two programs gave different tokens")
    for name in PROGRAMS:
        print(f"{name} program: {seconds[name] / steps[name] * 1e3:.2f} ms per decode step over {steps[name]} steps")


if __name__ == "__main__":
    main()
