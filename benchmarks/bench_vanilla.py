"""Vanilla greedy decode: specjax vs transformers `generate` on the same weights, side by side.

Reports tokens/s of both (wall time of `generate`, prefill included, for both), their ratio, and
the fraction of the memory-bandwidth roofline that our decode steps reach (roofline: measured
copy bandwidth / bytes of weights read per token; STREAM convention, bytes read + written).

    python benchmarks/bench_vanilla.py --prompts ../shared/data/dev_prompts.jsonl --limit 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import machine, read_prompts
from tqdm import tqdm


def copy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a large numpy copy, best of `repeats`."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--category", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/vanilla.json")
    args = ap.parse_args()

    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from specjax import Engine, load_model
    from specjax.prompts import encode_prompt

    model = load_model(args.model)
    tok = model.tokenizer
    prompts = [encode_prompt(tok, p, raw=False) for p in read_prompts(Path(args.prompts), args.limit, args.category)]
    n = args.max_new_tokens
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()
    engine = Engine(model.params, model.config, num_pages=64, page_size=16)

    ours_s = hf_s = ours_decode_s = 0.0
    ours_tok = hf_tok = 0
    matches = 0
    for prompt in tqdm(prompts, desc="prompts"):
        engine.generate([prompt], n, eos_token_ids=(), warmup=True)
        out = engine.generate([prompt], n, eos_token_ids=())
        ours_s += out.seconds
        ours_decode_s += out.seconds - out.prefill_seconds
        ours_tok += len(out.token_ids[0])
        with torch.no_grad():
            t = time.perf_counter()
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            hf_s += time.perf_counter() - t
        ref_ids = ref[0, len(prompt) :].tolist()
        hf_tok += len(ref_ids)
        matches += ref_ids == out.token_ids[0]

    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    bw = copy_bandwidth()
    roofline = bw / weight_bytes
    ours, theirs = ours_tok / ours_s, hf_tok / hf_s
    # The roofline is about decoding: one weight read per token (prefill excluded).
    ours_decode = ours_tok / ours_decode_s
    result = {
        "machine": machine(),
        "model": args.model,
        "prompts": len(prompts),
        "max_new_tokens": n,
        "batch": 1,
        "specjax_tokens_per_s": round(ours, 2),
        "transformers_tokens_per_s": round(theirs, 2),
        "speedup_vs_transformers": round(ours / theirs, 3),
        "weight_bytes": weight_bytes,
        "copy_bandwidth_GBps": round(bw / 1e9, 2),
        "specjax_decode_tokens_per_s": round(ours_decode, 2),
        "roofline_tokens_per_s": round(roofline, 2),
        "decode_fraction_of_roofline": round(ours_decode / roofline, 3),
        "greedy_identical_prompts": f"{matches}/{len(prompts)}",
        "jax": jax.__version__,
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
