"""End-to-end A/B of a CPU kernel: the same methods and prompts with XLA's version and with the
kernel, in one process (arms alternate, ABAB by default).

    python benchmarks/ab_cpu_matmul.py --prompts ../shared/data/dev_prompts.jsonl --limit 3 \
        --methods vanilla,eagle2,pld:min_matching_ngram_size=2 --out runs/ab_cpu_matmul
    python benchmarks/ab_cpu_matmul.py --kernel attention ...   # specjax.cpu_attention
    python benchmarks/ab_cpu_matmul.py --kernel half-draft ...  # float16 draft weights
    python benchmarks/ab_cpu_matmul.py --kernel int8-draft ...  # int8 draft weights

`--kernel matmul` (default) compares XLA's products with specjax.cpu_matmul's (attention on its
default backend); `--kernel attention` compares the XLA attention reference with
specjax.cpu_attention's kernel (products on the matmul kernel); `--kernel half-draft` compares
draft networks with float32 weights ("xla" arm) against float16 ones ("kernel" arm,
specjax.cpu_matmul.draft_weights), both on the kernels; `--kernel int8-draft` float16 draft
weights ("xla" arm) against int8 ones ("kernel" arm). Each arm is one
`specjax.bench.run_bench` (methods interleaved per prompt); the table gives each method's
tokens/s per arm, the kernel's gain, and the speedup over the same arm's vanilla.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specjax.bench import machine, run_bench
from specjax.compile_cache import enable_compile_cache
from kernels_pallas import use_attention_backend
from specjax.cpu_matmul import use_cpu_matmul, use_draft_weights


def arm_setting(kernel: str, arm: str):
    """The `with` block that runs `arm` ("xla" or "kernel") of `kernel` ("matmul", "attention",
    "half-draft" or "int8-draft")."""
    if kernel == "attention":
        return use_attention_backend("cpu" if arm == "kernel" else "xla")
    if kernel == "half-draft":
        return use_draft_weights("float16" if arm == "kernel" else "float32")
    if kernel == "int8-draft":
        return use_draft_weights("int8" if arm == "kernel" else "float16")
    return use_cpu_matmul(arm)


def run(model, methods, prompts, out: Path, limit, arms, kernel: str = "matmul") -> list[dict]:
    """Per (arm index, arm, category, method): tokens/s and speedup over that arm's vanilla."""
    rows = []
    for i, arm in enumerate(arms):
        with arm_setting(kernel, arm):
            res = run_bench(model, methods, prompts, out / f"{i}-{arm}", limit=limit)
        for r in res["rows"]:
            if r["library"] == "specjax":
                rows.append({"run": i, "arm": arm, "category": r["category"],
                             "method": r["method"], "tokens_per_s": r["tokens_per_s"],
                             "speedup_vs_vanilla": r["speedup_vs_vanilla"],
                             "mean_accepted": r["mean_accepted"],
                             "greedy_equals_vanilla": r["greedy_equals_vanilla"]})
    return rows


def markdown(rows) -> str:
    """Mean over repeats of each arm: tokens/s (xla, kernel), gain, speedup vs own vanilla."""
    def mean(arm, cat, method, key):
        v = [r[key] for r in rows if (r["arm"], r["category"], r["method"]) == (arm, cat, method)]
        return sum(v) / len(v) if v else float("nan")

    keys = list(dict.fromkeys((r["category"], r["method"]) for r in rows))
    out = ["| category | method | tokens/s, XLA | tokens/s, kernel | kernel / XLA | "
           "speedup vs vanilla, XLA | speedup vs vanilla, kernel |", "|---|---|---|---|---|---|---|"]
    for cat, method in keys:
        x, k = (mean(a, cat, method, "tokens_per_s") for a in ("xla", "kernel"))
        sx, sk = (mean(a, cat, method, "speedup_vs_vanilla") for a in ("xla", "kernel"))
        out.append(f"| {cat} | `{method}` | {x:.2f} | {k:.2f} | {k / x:.2f}x | {sx:.2f}x | "
                   f"{sk:.2f}x |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="vanilla,eagle2")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["xla", "kernel", "xla", "kernel"],
                    choices=["xla", "kernel"])
    ap.add_argument("--kernel", choices=["matmul", "attention", "half-draft", "int8-draft"],
                    default="matmul")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    enable_compile_cache()
    out = Path(args.out)
    rows = run(args.model, args.methods.split(","), args.prompts, out, args.limit, args.arms,
               args.kernel)
    table = markdown(rows)
    (out / "ab.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    (out / "ab.md").write_text(f"{machine()}, {args.model}, {args.kernel} kernel, arms "
                               f"{' '.join(args.arms)}\n\n"
                               f"{table}\n")
    print(table)


if __name__ == "__main__":
    main()
