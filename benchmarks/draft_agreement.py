"""How well an EAGLE head's draft distribution q matches the target's p, on greedy and sampled text.

    python benchmarks/draft_agreement.py --heads specjax/shipped_heads/smollm2-135m/eagle
    python benchmarks/draft_agreement.py --heads runs/eagle/heads --n 48 --temperatures 0 1

The base model answers `--n` prompts (spread over the categories) greedily and at each sampling
temperature; then, teacher-forced over each answer, the head drafts its 1st, 2nd and 3rd token
(`--draft-steps`, the later ones from its own predicted features, as it drafts at test time).
Per drafted step and per kind of answer it reports:

- agreement: the head's most likely token is the target's (what a greedy draft's acceptance
  follows);
- 1 - TV(p, q) at that temperature: the probability that one child drawn from q is accepted by
  rejection sampling, the `recursive` rule's acceptance of a tree's first child;
- the target's mass on the draft vocabulary (`draft_ids`, cut to `--draft-vocab`): tokens outside
  it are never drafted.

Answers are cached in `--work` (resumable), so comparing heads reruns only the teacher forcing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench import machine
from specjax.loading import load_model
from specjax.model import lm_head_weight
from specjax.proposers.eagle_net import load_eagle_heads
from specjax.training import losses
from specjax.training.data import DistillConfig, distill, read_prompt_file, sequences_of, spread_over_categories
from specjax.training.features import length_bucket, padded_sequences, teacher_forward
from specjax.training.trainers import EagleMethod


@jax.jit
def step_sums(target_logits, draft_logits, draft_ids, temperature, draft_scale):
    """Sums over positions [N] of (agreement, p's mass on the draft vocabulary, 1 - TV(p, q)),
    p at `temperature` and q at temperature x draft_scale (argmax only at 0; TV then taken at
    temperature 1)."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    p = jax.nn.softmax(target_logits / t, axis=-1)[:, draft_ids]
    q = jax.nn.softmax(draft_logits / (t * draft_scale), axis=-1)
    agree = draft_ids[jnp.argmax(draft_logits, -1)] == jnp.argmax(target_logits, -1)
    return jnp.stack([jnp.sum(agree), jnp.sum(p), jnp.sum(jnp.minimum(p, q))])


def measure(model, draft, draft_ids, rows, steps: int, temperature: float, draft_scale: float = 1.0) -> list[dict]:
    """Per drafted step: mean agreement, target mass on the draft vocabulary, 1 - TV."""
    head = lm_head_weight(model.params).astype(jnp.float32)
    draft_head = head[draft_ids]
    method = EagleMethod(steps=steps)
    sums, count = np.zeros((steps, 3)), np.zeros(steps)
    seqs = sequences_of(rows, 512)
    for s in range(0, len(seqs), 8):
        chunk = seqs[s : s + 8]
        batch = padded_sequences(chunk, length_bucket(max(len(t) for t, _ in chunk)))
        tok, mask, valid = (jnp.asarray(batch[k]) for k in ("tokens", "mask", "valid"))
        final = teacher_forward(model.params, model.config, tok, valid)["final"]
        _, feats, _, pairs = losses.eagle_shift(tok, final, mask, valid)
        preds = method.draft(draft, model.params, model.config, tok, feats, valid)
        for i, pred in enumerate(preds):
            keep = np.nonzero(np.asarray(losses.shift_left(pairs, i) & valid))
            target = losses.shift_left(final, 1 + i)[keep]  # the feature whose token step i drafts
            sums[i] += np.asarray(
                step_sums(target @ head.T, pred[keep] @ draft_head.T, draft_ids, temperature, draft_scale)
            )
            count[i] += len(keep[0])
    return [
        {
            "step": i + 1,
            "positions": int(count[i]),
            "agreement": sums[i, 0] / count[i],
            "mass_in_draft_vocab": sums[i, 1] / count[i],
            "one_minus_tv": sums[i, 2] / count[i],
        }
        for i in range(steps)
    ]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", required=True, help="an EAGLE head folder (specjax format)")
    p.add_argument("--base", default="smollm2-135m")
    p.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    p.add_argument("--n", type=int, default=48, help="prompts, spread over the categories")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--draft-vocab", type=int, default=4096, help="rows of draft_ids scored")
    p.add_argument("--draft-steps", type=int, default=3)
    p.add_argument(
        "--draft-scale",
        type=float,
        default=1.0,
        help="q's temperature relative to p's (a calibration that is still lossless)",
    )
    p.add_argument("--work", default="runs/draft_agreement", help="cache of the answers")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    model = load_model(args.base, dtype=jnp.float32, pack=False)
    records = read_prompt_file(args.prompts)
    indices = spread_over_categories(records, args.n)
    _, draft = load_eagle_heads(args.heads, model.config)
    draft_ids = draft.pop("draft_ids")[: args.draft_vocab]
    draft = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), draft)
    result = {
        "heads": args.heads,
        "prompts": args.prompts,
        "n": len(indices),
        "draft_vocab": int(draft_ids.shape[0]),
        "draft_scale": args.draft_scale,
        "machine": machine(),
        "answers": {},
    }
    for temp in args.temperatures:
        folder = Path(args.work) / f"answers_t{temp:g}"
        rows = distill(model, records, indices, folder, DistillConfig(temperature=temp))
        result["answers"][f"{temp:g}"] = measure(
            model, draft, draft_ids, rows, args.draft_steps, temp, args.draft_scale
        )
        for r in result["answers"][f"{temp:g}"]:
            print(
                f"answers at T={temp:g}, drafted token {r['step']}: agreement "
                f"{r['agreement']:.3f}, 1 - TV {r['one_minus_tv']:.3f}, target mass on the "
                f"draft vocabulary {r['mass_in_draft_vocab']:.3f} ({r['positions']} positions)",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
