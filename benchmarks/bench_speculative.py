"""Prompt-Lookup, Lookahead and Draft-Target (self-draft) decoding vs vanilla, ours and transformers', side by side.

Up to --max-new-tokens per prompt, stopping at EOS (as users decode). For each category of the
prompt file: mean accepted tokens per target pass, tokens/s and speedup
over the same library's vanilla decoding, and whether our greedy output equals our vanilla output.
Peers, on the same weights and prompts: transformers `generate` (vanilla), with
`prompt_lookup_num_tokens`, and assisted generation with the same self-draft as a PyTorch model.

    python benchmarks/bench_speculative.py --categories summarization code --limit 5
    python benchmarks/bench_speculative.py --categories summarization code chat math --pld 10:2 \
        --lookahead 7,5,7 --no-draft --no-hf --out benchmarks/results/lookahead.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from common import machine, read_prompts
from plot_speedup import plot


def hf_self_draft(hf_model, num_layers: int):
    """transformers' model truncated to its first `num_layers` layers (same weights)."""
    import copy

    import torch

    draft = copy.deepcopy(hf_model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    return draft


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    ap.add_argument("--categories", nargs="+", default=["summarization", "code"])
    ap.add_argument("--limit", type=int, default=5, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--pld", nargs="+", default=["10:1", "10:2"],
                    help="PLD settings to run, as prompt_lookup_num_tokens:min_matching_ngram_size"
                         " (HF runs the first one's token count)")
    ap.add_argument("--lookahead", nargs="*", default=[],
                    help="Lookahead settings to run, as W,N,G (e.g. 7,5,7)")
    ap.add_argument("--no-draft", action="store_true", help="skip the self-draft method")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--max-draft-len", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    args = ap.parse_args()

    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from specjax import Engine, load_model
    from specjax.cli import encode_prompt
    from specjax.methods import make_proposer

    model = load_model(args.model)
    tok = model.tokenizer
    n = args.max_new_tokens
    engine = Engine(model.params, model.config, num_pages=96, page_size=16)
    ours = {"vanilla": make_proposer("vanilla", model)}
    pld = [tuple(int(x) for x in spec.split(":")) for spec in args.pld]
    for k, lo in pld:
        ours[f"pld k={k} min-ngram={lo}"] = make_proposer(
            "pld", model, prompt_lookup_num_tokens=k, min_matching_ngram_size=lo)
    for spec in args.lookahead:
        wng = tuple(int(x) for x in spec.split(","))
        ours["lookahead W,N,G={},{},{}".format(*wng)] = make_proposer("lookahead", model,
                                                                      lookahead=wng)
    if not args.no_draft:
        ours[f"draft-{args.draft_layers}L-k{args.max_draft_len}"] = make_proposer(
            "draft", model, draft_layers=args.draft_layers, max_draft_len=args.max_draft_len)
    hf = hf_draft = None
    if not args.no_hf:
        hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()
        hf_draft = hf_self_draft(hf, args.draft_layers)
        # Same draft length as ours (transformers' default schedule grows it to 20 tokens).
        hf_draft.generation_config.num_assistant_tokens = args.max_draft_len
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"

    rows = []
    for cat in args.categories:
        prompts = [encode_prompt(tok, p, raw=False)
                   for p in read_prompts(Path(args.prompts), args.limit, cat)]
        acc = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "match": 0} for name in ours}
        hf_acc = {name: {"tokens": 0, "seconds": 0.0} for name in ("hf-vanilla", "hf-pld", "hf-assisted")}
        for prompt in tqdm(prompts, desc=cat):
            reference = None
            for name, (proposer, pparams) in ours.items():
                kw = dict(proposer=proposer, proposer_params=pparams)
                engine.generate([prompt], n, warmup=True, **kw)
                out = engine.generate([prompt], n, **kw)
                a = acc[name]
                a["tokens"] += len(out.token_ids[0])
                a["seconds"] += out.seconds
                a["steps"] += out.steps[0]
                if reference is None:
                    reference = out.token_ids[0]
                a["match"] += out.token_ids[0] == reference
            if hf is None:
                continue
            ids = torch.tensor([prompt])
            for name, extra in (("hf-vanilla", {}),
                                ("hf-pld", {"prompt_lookup_num_tokens": pld[0][0]}),
                                ("hf-assisted", {"assistant_model": hf_draft})):
                with torch.no_grad():
                    t = time.perf_counter()
                    res = hf.generate(ids, max_new_tokens=n, do_sample=False, **extra)
                    hf_acc[name]["seconds"] += time.perf_counter() - t
                hf_acc[name]["tokens"] += res.shape[1] - ids.shape[1]
        base = acc["vanilla"]["tokens"] / acc["vanilla"]["seconds"]
        for name, a in acc.items():
            tps = a["tokens"] / a["seconds"]
            rows.append({"category": cat, "method": f"specjax {name}", "prompts": len(prompts),
                         "mean_accepted": round(a["tokens"] / a["steps"], 3),
                         "tokens_per_s": round(tps, 2), "speedup_vs_own_vanilla": round(tps / base, 3),
                         "greedy_equals_vanilla": f"{a['match']}/{len(prompts)}"})
        if hf is not None:
            hf_base = hf_acc["hf-vanilla"]["tokens"] / hf_acc["hf-vanilla"]["seconds"]
            for name, a in hf_acc.items():
                tps = a["tokens"] / a["seconds"]
                rows.append({"category": cat, "method": f"transformers {name[3:]}",
                             "prompts": len(prompts), "mean_accepted": None,
                             "tokens_per_s": round(tps, 2),
                             "speedup_vs_own_vanilla": round(tps / hf_base, 3),
                             "greedy_equals_vanilla": None})
    result = {"machine": machine(), "model": args.model, "max_new_tokens": n, "batch": 1,
              "jax": jax.__version__, "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    header = "| category | method | mean accepted | tokens/s | speedup vs own vanilla | greedy = vanilla |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['category']} | {r['method']} | {r['mean_accepted'] or '-'} | "
                     f"{r['tokens_per_s']} | {r['speedup_vs_own_vanilla']:.2f}x | "
                     f"{r['greedy_equals_vanilla'] or '-'} |")
    table = "\n".join(lines)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    plot(rows, Path(args.out).with_suffix(".png"),
         f"{args.model}, batch 1, up to {n} tokens, {result['machine']}")
    print(table)


if __name__ == "__main__":
    main()
