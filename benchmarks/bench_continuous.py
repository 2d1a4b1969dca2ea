"""Continuous batching against fixed batches: many prompts, vanilla greedy decoding, one process.

`Engine.generate_continuous` (a finished slot takes the next prompt) and `Engine.generate` over
consecutive batches of the same size, on the same prompts in the same order (each on a fresh
engine, so neither reuses the other's prefix pages). Wall time includes prefill; with
`--rounds 2` the first round compiles (or loads from the compile cache) and the second shows
the steady state of a long job. Answers are compared prompt by prompt.

    python benchmarks/bench_continuous.py --prompts ../shared/data/train_prompts.jsonl \
        --start 2400 --limit 192 --slots 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import machine


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="../shared/data/train_prompts.jsonl")
    ap.add_argument("--start", type=int, default=0, help="first record of the file")
    ap.add_argument("--limit", type=int, default=192, help="prompts, in file order")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each in this process")
    ap.add_argument("--out", default="benchmarks/results/continuous.json")
    args = ap.parse_args()

    import specjax
    from specjax import Engine, load_model
    from specjax.compile_cache import enable_compile_cache
    from specjax.training.data import encode_record, length_sorted_windows, read_prompt_file

    enable_compile_cache()
    model = load_model(args.model)
    records = read_prompt_file(args.prompts)[args.start : args.start + args.limit]
    todo = [(i, encode_record(model.tokenizer, r)[-512:]) for i, r in enumerate(records)]
    prompts = [p for _, p in length_sorted_windows(todo, 8 * args.slots)]  # as distillation does
    eos = sorted(set(model.config.eos_token_ids))
    pages = 2 * args.slots * (-(-(512 + args.max_new_tokens + 64) // 16)) + 8

    def fresh():
        return Engine(model.params, model.config, num_pages=pages, page_size=16)

    cont_s, fixed_s = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        cont = {
            r.index: r.token_ids
            for r in fresh().generate_continuous(prompts, args.max_new_tokens, slots=args.slots, eos_token_ids=eos)
        }
        cont_s.append(time.perf_counter() - t)
        eng = fresh()
        t = time.perf_counter()
        fixed = []
        for s in range(0, len(prompts), args.slots):
            fixed += eng.generate(prompts[s : s + args.slots], args.max_new_tokens, eos_token_ids=eos).token_ids
        fixed_s.append(time.perf_counter() - t)
    tokens = sum(map(len, fixed))
    res = {
        "machine": machine(),
        "code": str(Path(specjax.__file__).parent),
        "prompts": len(prompts),
        "slots": args.slots,
        "max_new_tokens": args.max_new_tokens,
        "new_tokens": tokens,
        "continuous_s": [round(x, 1) for x in cont_s],
        "fixed_batches_s": [round(x, 1) for x in fixed_s],
        "speedup": [round(f / c, 3) for f, c in zip(fixed_s, cont_s)],
        "same_answers": sum(cont[i] == a for i, a in enumerate(fixed)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
