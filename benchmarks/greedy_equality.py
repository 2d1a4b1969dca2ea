"""Greedy output of each method against vanilla's on a whole prompt file, batched.

`specjax bench` compares outputs too, but one prompt at a time at batch 1 and with timing; this
runs every prompt of a file (the dev set's 297) through `Engine.generate` in batches, vanilla
first, then each method with its default settings, verifying whole draft trees every step
(`fixed_speculation`: with the budget on, a batch of 8 on a CPU decodes mostly without drafting,
which would test little; `--budget` runs it), and sorts each output into equal, near-tie (the
first difference sits where the target's two best logits are within float32 rounding:
`specjax.greedy_check`) or differ. Vanilla's outputs are kept in --out and reused by a rerun
with the same settings. Writes results.json and results.md in --out.

    python benchmarks/greedy_equality.py --prompts ../shared/data/dev_prompts.jsonl \
        --methods suffix,eagle2,eagle1,eagle3,medusa,redrafter --out runs/greedy_dev
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--methods", default="suffix,eagle2", help="comma-separated, `specjax bench` syntax")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)")
    ap.add_argument("--budget", action="store_true", help="the speculation budget on (default: whole trees)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from specjax import Engine, load_model
    from specjax.bench import MethodSpec, read_bench_prompts
    from specjax.greedy_check import compare
    from specjax.methods import make_proposer
    from specjax.prompts import encode_prompt

    model = load_model(args.model)
    prompts = read_bench_prompts(args.prompts, limit=args.limit)
    encoded = [encode_prompt(model.tokenizer, p["text"], raw=False) for p in prompts]
    # batches of similar lengths, so a batch's pages and shapes stay small
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    batches = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    page = 16
    longest = max(map(len, encoded)) + args.max_new_tokens + 64
    engine = Engine(model.params, model.config, page_size=page, num_pages=args.batch * -(-longest // page) + 16)
    specs = [MethodSpec.parse(m) for m in args.methods.split(",") if m.strip()]

    def run(proposer=None, pparams=None, label="vanilla"):
        out, t0 = [None] * len(encoded), time.perf_counter()
        for batch in tqdm(batches, desc=label):
            res = engine.generate(
                [encoded[i] for i in batch],
                args.max_new_tokens,
                eos_token_ids=(),
                proposer=proposer,
                proposer_params=pparams,
                fixed_speculation=not args.budget,
            )
            for i, ids, steps in zip(batch, res.token_ids, res.steps):
                out[i] = (ids, steps)
        return out, time.perf_counter() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept = out / "vanilla.json"
    settings = [args.model, args.prompts, args.limit, args.max_new_tokens, args.batch]
    if kept.exists() and json.loads(kept.read_text())["settings"] == settings:
        vanilla = json.loads(kept.read_text())["outputs"]
    else:
        vanilla, _ = run()
        kept.write_text(json.dumps({"settings": settings, "outputs": vanilla}))
    results = {"model": args.model, "prompts": args.prompts, "count": len(encoded), "methods": {}}
    results["max_new_tokens"], results["batch"] = args.max_new_tokens, args.batch
    results["budget"] = args.budget
    for spec in specs:
        proposer, pparams = make_proposer(spec.method, model, **dict(spec.options))
        got, seconds = run(proposer, pparams, spec.label)
        verdicts = {"equal": 0, "near-tie": 0, "differ": 0}
        differ = []
        for i, ((want, _), (ids, _)) in enumerate(zip(vanilla, got)):
            verdict, at, gap = compare(model.params, model.config, encoded[i], want, ids)
            verdicts[verdict] += 1
            if verdict != "equal":
                cat = prompts[i]["category"]
                differ.append({"prompt": i, "category": cat, "verdict": verdict, "at": at, "gap": gap})
        tokens, passes = sum(len(g[0]) for g in got), sum(g[1] for g in got)
        results["methods"][spec.label] = {
            **verdicts,
            "tokens_per_pass": tokens / max(passes, 1),
            "seconds": seconds,
            "not_equal": differ,
        }
        print(spec.label, verdicts, f"{tokens / max(passes, 1):.2f} tokens/pass", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))  # so far: a stopped run keeps it
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"{args.model}, {len(encoded)} prompts of {args.prompts}, greedy, {args.max_new_tokens} new tokens, "
        f"batches of {args.batch}, {'the speculation budget on' if args.budget else 'whole trees every step'}",
        "",
        "| method | equal | near-tie | differ | tokens per target pass |",
        "|---|---|---|---|---|",
    ]
    for label, r in results["methods"].items():
        lines.append(f"| {label} | {r['equal']} | {r['near-tie']} | {r['differ']} | {r['tokens_per_pass']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
