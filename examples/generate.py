"""The convenience API: every decoding method on the same prompt, one line each.

`Engine.generate` owns the KV cache and the compiled loops; `make_proposer` builds a method by
name (with the trained heads that ship in specjax/shipped_heads/ for the embedded model). Each line shows
the mean number of tokens a target forward pass produced (1.0 for vanilla decoding), tokens/s
after a warm-up compile, the speedup over vanilla, and whether the greedy text equals vanilla's
(speculative decoding is lossless: it must).

    python examples/generate.py [--prompt TEXT] [--max-new-tokens N]
    python examples/generate.py --smoke        # 3 methods, few tokens (SPECJAX_EXAMPLES_SMOKE=1)
"""

from __future__ import annotations

import argparse

import specjax
from specjax import Engine, settings
from specjax.methods import make_proposer
from specjax.prompts import encode_prompt

# Every method with settings that suit a CPU (docs/benchmarks.md, "Every method"); the head
# methods take the tree sizes their shipped checkpoints recommend.
METHODS = {
    "vanilla": {},
    "pld": {"min_matching_ngram_size": 2},  # Prompt-Lookup: copy n-grams from the context
    "draft": {"draft_layers": 8, "max_draft_len": 3},  # self-draft: the first 8 layers
    "lookahead": {"lookahead": (1, 5, 3)},  # (W, N, G): Jacobi window + n-gram pool
    "medusa": {},  # extra heads guess tokens 2, 3, ... ahead
    "eagle1": {},  # EAGLE-1: a draft layer over the target's features, static tree
    "eagle2": {},  # EAGLE-2: the same heads, tree grown by draft confidence
    "eagle3": {},  # EAGLE-3: fuses three target layers
    "redrafter": {},  # ReDrafter: recurrent drafter + beam search
}
SMOKE_METHODS = ("vanilla", "pld", "eagle2")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A prompt whose answer repeats the prompt's text, where Prompt-Lookup shines.
    ap.add_argument(
        "--prompt",
        default=(
            'Fix the spelling mistakes in this text and write it out in full: "The quick brown fox '
            "jumpd over the lazy dog. The dog was not amused and chasd the fox into the forrest, "
            'where they both got lost until mornig."'
        ),
    )
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--methods", default=None, help="comma-separated subset of: " + ",".join(METHODS))
    ap.add_argument("--smoke", action="store_true", help="3 methods, few tokens (CI)")
    args = ap.parse_args()
    smoke = args.smoke or settings.examples_smoke()
    max_new = args.max_new_tokens or (24 if smoke else 128)
    names = args.methods.split(",") if args.methods else (SMOKE_METHODS if smoke else list(METHODS))
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method {unknown[0]!r} (methods: {', '.join(METHODS)})")
    names = ["vanilla"] + [n for n in names if n != "vanilla"]  # the baseline comes first

    model = specjax.load_model("smollm2-135m")
    prompt = encode_prompt(model.tokenizer, args.prompt, raw=False)  # chat template, as the CLI
    engine = Engine(model.params, model.config, num_pages=64, page_size=16)

    baseline = None  # (tokens, tokens/s) of vanilla decoding
    for name in names:
        proposer, params = make_proposer(name, model, **METHODS[name])
        kw = dict(proposer=proposer, proposer_params=params)
        engine.generate([prompt], max_new, warmup=True, **kw)  # compile, not timed
        out = engine.generate([prompt], max_new, **kw)
        ids, rate = out.token_ids[0], out.new_tokens[0] / out.seconds
        if baseline is None:
            baseline = (ids, rate)
            print("text=" + repr(model.tokenizer.decode(ids, skip_special_tokens=True)))
        print(
            f"method={name} mean_accepted={out.mean_accepted[0]:.2f} tokens_per_s={rate:.1f} "
            f"speedup={rate / baseline[1]:.2f} same_as_vanilla={ids == baseline[0]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
