"""A/B in one process: Lookahead under sampling with spec_step taking the argmax of every
verified node (before commit 25a7374) against only the window's top level (`argmax_nodes`).

    python benchmarks/ab_lookahead_argmax.py     # from the project root; ~5 minutes

Lookahead (7, 5, 7) samples at temperature 0.7, top-k 50, top-p 0.9 on the first dev prompt of
each category (128 new tokens, same seeds), arms alternating over three rounds. Both arms give
the same outputs and tokens per step (the window reads the same rows).
"""
import dataclasses

from specjax import Engine, SamplingConfig, load_model
from specjax.bench import machine, read_bench_prompts
from specjax.prompts import encode_prompt
from specjax.proposers.lookahead import LookaheadProposer


@dataclasses.dataclass(frozen=True)
class EveryNode(LookaheadProposer):
    @property
    def argmax_nodes(self):
        return 0, self.tree_size


model = load_model("smollm2-135m")
prompts = read_bench_prompts("../shared/data/dev_prompts.jsonl", limit=1)
enc = [encode_prompt(model.tokenizer, p["text"], raw=False) for p in prompts]
eng = Engine(model.params, model.config, num_pages=128)
s = SamplingConfig(0.7, 50, 0.9)
arms = {"every node": EveryNode(), "top level": LookaheadProposer()}
secs = {a: 0.0 for a in arms}
seen = {}
for round_ in range(3):
    for name, prop in arms.items():
        toks = steps = 0
        outs = []
        for i, e in enumerate(enc):
            kw = dict(proposer=prop, sampling=s, seeds=[i])
            if round_ == 0:
                eng.generate([e], 128, warmup=True, **kw)
            r = eng.generate([e], 128, **kw)
            toks += len(r.token_ids[0]); secs[name] += r.seconds; steps += r.steps[0]
            outs.append(r.token_ids[0])
        seen.setdefault(name, outs)
        print(round_, name, f"{toks / steps:.3f} tokens/step", flush=True)
print(machine())
print("same outputs:", seen["every node"] == seen["top level"])
a, b = secs["every node"], secs["top level"]
print(f"every node {a:.2f} s  top level {b:.2f} s  ({a / b:.3f}x)")
