"""A/B in one process: jax.random.categorical against specjax.sampling.categorical (the same
draws through argmax_last) in sampled vanilla and EAGLE-2 decoding; greedy vanilla, which draws
nothing, runs in both arms as the control for this machine's drift.

Usage: python benchmarks/ab_argmax.py PROMPTS.jsonl [LIMIT]
"""
import json
import sys

import jax
import jax.numpy as jnp

import specjax.accept as accept
import specjax.proposers.draft_model as draft_model
import specjax.sampling as sampling
from specjax import Engine, SamplingConfig, load_model
from specjax.prompts import encode_prompt
from specjax.methods import make_proposer

NEW = {"categorical": sampling.categorical}
OLD = {"categorical": lambda k, x: jax.random.categorical(k, x).astype(jnp.int32)}


def use(impl):
    for mod in (sampling, accept, draft_model):
        for name, fn in impl.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
    jax.clear_caches()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path, limit = args[0], int(args[1]) if len(args) > 1 else 3
    model = load_model("smollm2-135m")
    rows = [json.loads(line) for line in open(path)][:limit]
    enc = [encode_prompt(model.tokenizer, r["turns"][0], raw=False) for r in rows]
    eng = Engine(model.params, model.config, num_pages=256)
    eagle2 = make_proposer("eagle2", model)
    cases = [("vanilla greedy", None, SamplingConfig()),
             ("vanilla sampled", None, SamplingConfig(0.7, 50, 0.9)),
             ("eagle2 sampled", eagle2, SamplingConfig(0.7, 50, 0.9))]
    res = {}
    rounds = (("jax", OLD), ("specjax", NEW), ("jax ", OLD), ("specjax ", NEW))
    if "--new-first" in sys.argv:
        rounds = rounds[1::-1] + rounds[:1:-1]
    for label, impl in rounds:
        use(impl)
        for name, (p, pp), s in ((c[0], c[1] or (None, None), c[2]) for c in cases):
            seconds, steps, tokens = 0.0, 0, []
            for i, e in enumerate(enc):
                kw = dict(proposer=p, proposer_params=pp, sampling=s, seeds=[i])
                eng.generate([e], 128, warmup=True, **kw)
                out = eng.generate([e], 128, **kw)
                seconds += out.seconds - out.prefill_seconds
                steps += out.steps[0]
                tokens.append(out.token_ids[0])
            r = res.setdefault((label.strip(), name), [])
            r.append((1000 * seconds / steps, tokens))
            print(f"{label.strip():12s} {name:16s} {1000 * seconds / steps:6.2f} ms/step", flush=True)
    print("\nbest of two rounds, ms per step (same tokens in both):")
    for name in (c[0] for c in cases):
        old = res[("jax", name)]
        new = res[("specjax", name)]
        same = all(o[1] == n[1] for o in old for n in new)
        a, b = min(o[0] for o in old), min(n[0] for n in new)
        print(f"{name:16s} {a:6.2f} -> {b:6.2f} ms/step ({a / b:.3f}x)  same tokens: {same}")


if __name__ == "__main__":
    main()
