"""The every-method table of docs/benchmarks.md: each method with the shipped heads and CPU
settings, and the head methods again with prompt lookup grafted onto their trees, on the same
dev prompts.

    python benchmarks/bench_methods.py --out runs/bench_methods --limit 6

Methods run interleaved per prompt (`specjax.bench.run_bench`); the output folder gets
results.{json,md,png} and resumes when re-run. Lookahead's option holds commas, which is why
this is a script rather than one `specjax bench --methods ...` line.
"""

from __future__ import annotations

import argparse

PLD = "min_matching_ngram_size=2"
TREE6 = "eagle_total_tokens=6:eagle_depth=3:eagle_top_k=2"
GRAFT = f"lookup_tokens=5:{PLD}"
# The EAGLE-2 targets: a larger tree, its last nodes giving way to lookup's within 9 rows.
CAPPED = f"eagle_total_tokens=8:eagle_depth=3:eagle_top_k=2:lookup_tokens=6:{PLD}:lookup_width=9"

METHODS = [
    "vanilla",
    f"pld:{PLD}",
    "lookahead:lookahead=[1,2,3]",
    "draft:draft_layers=8:max_draft_len=3",
    "medusa",
    "eagle1",
    "eagle2",
    "eagle3",
    "redrafter",
    f"eagle2:{TREE6}",
    f"medusa:{GRAFT}",
    f"eagle1:{GRAFT}",
    f"eagle2:{GRAFT}",
    f"eagle3:{GRAFT}",
    f"redrafter:{GRAFT}",
    f"eagle2:{TREE6}:{GRAFT}",
    f"eagle2:{CAPPED}",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=6, help="prompts per category")
    ap.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    ap.add_argument("--methods", default=None, help="comma-free subset: METHOD;METHOD;...")
    args = ap.parse_args(argv)
    from specjax.bench import run_bench
    from specjax.compile_cache import enable_compile_cache

    enable_compile_cache()

    methods = args.methods.split(";") if args.methods else METHODS
    run_bench("smollm2-135m", methods, args.prompts, args.out, limit=args.limit)


if __name__ == "__main__":
    main()
