"""A/B in one process: top-k/top-p sampling as it was (top_k fused into its comparison, top-p by
sorting the vocabulary; before commit 71538ba) against `kth_largest` / `top_p_mask`, end to end.

    python benchmarks/ab_sampling_ops.py     # from the project root; ~10 minutes

Vanilla, Prompt-Lookup, EAGLE-2 and ReDrafter (shipped heads) sample at temperature 0.7, top-k 50,
top-p 0.9 on the first dev prompt of each category (128 new tokens, same seeds), once each: the
old functions patched into `specjax.sampling` (caches cleared, so everything is traced again),
then the new ones. Both give the same tokens per step (the same outputs).
"""
import jax, jax.numpy as jnp
import specjax.sampling as S
import specjax.proposers.redrafter as R
from specjax import Engine, SamplingConfig, load_model
from specjax.prompts import encode_prompt
from specjax.methods import make_proposer
from specjax.bench import read_bench_prompts, machine

def old_kth(x, k):
    return jax.lax.top_k(x, k)[0][..., -1:]
def old_top_p_mask(logits, top_p):
    sl = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sl, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    th = jnp.min(jnp.where(before < top_p, sl, jnp.inf), axis=-1, keepdims=True)
    return logits >= th
NEW = (S.kth_largest, S.top_p_mask)
def use(impl):
    S.kth_largest, S.top_p_mask = impl
    R.kth_largest = impl[0]
    jax.clear_caches()

model = load_model("smollm2-135m")
heads = "specjax/shipped_heads/smollm2-135m/"
methods = {"vanilla": (None, None), "pld": make_proposer("pld", model, min_matching_ngram_size=2),
           "eagle2": make_proposer("eagle2", model, heads=heads + "eagle"),
           "redrafter": make_proposer("redrafter", model, heads=heads + "redrafter")}
prompts = read_bench_prompts("../shared/data/dev_prompts.jsonl", limit=1)
enc = [encode_prompt(model.tokenizer, p["text"], raw=False) for p in prompts]
eng = Engine(model.params, model.config, num_pages=128)
s = SamplingConfig(0.7, 50, 0.9)
out = {}
for name, (prop, pp) in methods.items():
    for impl_name, impl in (("sort", (old_kth, old_top_p_mask)), ("new", NEW)):
        use(impl)
        toks = secs = steps = 0
        for i, e in enumerate(enc):
            kw = dict(proposer=prop, proposer_params=pp, sampling=s, seeds=[i])
            eng.generate([e], 128, warmup=True, **kw)
            r = eng.generate([e], 128, **kw)
            toks += len(r.token_ids[0]); secs += r.seconds; steps += r.steps[0]
        out[(name, impl_name)] = toks / secs
        print(name, impl_name, "%.2f tok/s, %.2f tokens/step" % (toks / secs, toks / steps), flush=True)
print(machine())
for name in methods:
    a, b = out[(name, "sort")], out[(name, "new")]
    print(f"{name:10s} sort {a:.2f} tok/s  new {b:.2f} tok/s  {b / a:.2f}x")
