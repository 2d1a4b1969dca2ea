"""Paired acceptance of two sampling rules on the same draft trees.

End-to-end runs of two rules differ by their samples: the texts part ways after a few tokens,
so over 40 prompts tokens per pass move by a few percent whatever the rules do. This script
decodes with the method's own rule and, at every step, also verifies that step's tree and target
logits with each rule under --keys fresh keys, averaging the drafted tokens accepted: the rules
are compared on identical inputs, and the difference has a small standard error.

    python benchmarks/paired_acceptance.py --method eagle2 --limit 3
    python benchmarks/paired_acceptance.py --method eagle --eagle-default-tree --no-lookup --limit 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specjax.spec_decode as spec_decode
from specjax import Engine, SamplingConfig, load_model
from specjax.bench import read_bench_prompts
from specjax.methods import make_proposer
from specjax.prompts import encode_prompt


def paired_accept(rules, n_keys: int, sink):
    """An `accept` that returns the decoder's own result and sends, per step, each rule's mean
    accepted count over n_keys keys on the same tree and logits to `sink`."""
    accept = spec_decode.accept

    def wrapped(tree, logits, keys, sampling, rule="match", **options):
        result = accept(tree, logits, keys, sampling, rule, **options)
        if not sampling.greedy:
            fresh = jax.random.split(jax.random.fold_in(keys[0], 7), n_keys)
            means = [
                jnp.mean(
                    jax.lax.map(
                        lambda k, r=r: accept(tree, logits, jnp.broadcast_to(k, keys.shape), sampling, r).n_accepted,
                        fresh,
                    ).astype(jnp.float32),
                    axis=0,
                )
                for r in rules
            ]
            jax.debug.callback(sink, *means)
        return result

    return wrapped


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="eagle2")
    ap.add_argument("--rules", default="recursive,traversal")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/dev_prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=3, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--keys", type=int, default=64, help="keys per rule and step")
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument(
        "--eagle-default-tree",
        action="store_true",
        help="EAGLE-1 over its 26-node default tree instead of the shipped heads' 3",
    )
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    rules = args.rules.split(",")
    steps = {r: [] for r in rules}

    def sink(*means):
        for r, m in zip(rules, means):
            steps[r].append(np.asarray(m))

    spec_decode.accept = paired_accept(rules, args.keys, sink)
    model = load_model("smollm2-135m")
    options = dict(no_lookup=True) if args.no_lookup else {}
    if args.eagle_default_tree:
        from specjax.proposers.eagle import EAGLE_DEFAULT_TREE

        options["eagle_choices"] = [list(c) for c in EAGLE_DEFAULT_TREE]
    proposer, params = make_proposer(args.method, model, **options)
    prompts = read_bench_prompts(args.prompts, None, args.limit)
    engine = Engine(model.params, model.config, page_size=16, num_pages=200)
    sampling = SamplingConfig(temperature=args.temperature)
    for n, p in enumerate(tqdm(prompts, desc="prompts")):
        engine.generate(
            [encode_prompt(model.tokenizer, p["text"], raw=False)],
            args.max_new_tokens,
            sampling=sampling,
            seeds=[n],
            proposer=proposer,
            proposer_params=params,
        )
    got = {r: np.concatenate(steps[r]) for r in rules}
    base = rules[0]
    result = {
        "method": args.method,
        "options": options,
        "prompts": len(prompts),
        "steps": int(len(got[base])),
        "keys": args.keys,
        "temperature": args.temperature,
        "proposer_rule": proposer.rule,
        "tokens_per_pass": {r: float(1 + got[r].mean()) for r in rules},
    }
    for r in rules[1:]:
        diff = got[r] - got[base]
        result[f"{r}_over_{base}"] = float((1 + got[r].mean()) / (1 + got[base].mean()))
        result[f"{r}_minus_{base}_se"] = float(diff.std() / np.sqrt(len(diff)))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
