"""Medusa trees fitted to a set of heads: the nodes that most often hold the right token.

A node of a `medusa_choices` tree is a path of ranks (r_1, ..., r_d): head j's r_j-th token at
depth j. At a position where the true continuation has ranks (q_1, q_2, ...) in the heads'
orderings, exactly the nodes on the prefix chain of q are right, and a step accepts as many
drafted tokens as that chain has nodes in the tree. So the mean accepted tokens per step of a
tree S over a set of positions is 1 + sum over nodes p in S of freq(p), freq(p) being the share
of positions whose true ranks start with p, and the best tree of n nodes is the n most frequent
prefixes (a child is never more frequent than its parent, so they form a tree). This is the
Medusa paper's tree construction with measured prefix frequencies in place of its product of
per-head accuracies, which assumes the heads err independently.

    python -m specjax.training.medusa_tree --heads specjax/shipped_heads/smollm2-135m/medusa \
        --data runs/mix3 --nodes 4 8 16 63 --out runs/medusa_trees.json

Measure on features the heads were not trained on (another data folder of the same base model).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("proposer",))
def _label_ranks(proposer, head_params, lm_head, features, labels):
    """int32[N, K]: each label's rank in its head's ordering (ties go to the lower index, as
    `lax.top_k` breaks them); labels < 0 (no label, or a token the heads cannot draft) get -1."""
    logits = proposer.heads.apply(head_params, features, lm_head)  # [N, K, V]
    x = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)
    idx = jnp.arange(logits.shape[-1])
    rank = jnp.sum((logits > x) | ((logits == x) & (idx < labels[..., None])), axis=-1)
    return jnp.where(labels >= 0, rank, -1).astype(jnp.int32)


def true_ranks(
    proposer, params, store, num_sequences: int | None = None, chunk: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """(int32[P, K], int64[S + 1]): at every answer position of the store's first
    `num_sequences` sequences, the rank of the true token k + 1 places after the pending one in
    head k's drafting order (-1 when it cannot be drafted: not in the heads' draft vocabulary,
    or past the answer's end); and where each sequence's rows start (consecutive positions).

    (proposer, params) as `make_proposer("medusa", ...)` returns them; features are the
    target's final hidden states, as decoding feeds them to the heads."""
    k = proposer.num_heads
    ids = params.get("draft_ids")
    index = None
    if ids is not None:  # labels as rows of the draft vocabulary
        index = np.full(proposer.vocab_size, -1, np.int64)
        index[np.asarray(ids)] = np.arange(len(ids))
    feats, labels = [], []
    n = len(store) if num_sequences is None else min(num_sequences, len(store))
    for i in range(n):
        seq = store.sequence(i)
        length = len(seq["tokens"])
        tokens = np.concatenate([seq["tokens"], np.full(k + 2, -1)])
        mask = np.concatenate([seq["mask"], np.zeros(k + 2, bool)])
        # Position t predicts token t + 1 (the pending token); head j drafts token t + j + 2.
        t = np.flatnonzero(mask[1 : length + 1] & mask[2 : length + 2])
        lab = np.stack([np.where(mask[t + j + 2], tokens[t + j + 2], -1) for j in range(k)], 1)
        if index is not None:
            lab = np.where(lab >= 0, index[np.maximum(lab, 0)], -1)
        feats.append(np.asarray(seq["final"][t]))
        labels.append(lab)
    offsets = np.cumsum([0] + [len(x) for x in labels])
    labels = np.concatenate(labels) if labels else np.zeros((0, k), np.int64)
    if not len(labels):
        raise ValueError("the features hold no answer positions with a label")
    feats = np.concatenate(feats)
    lm_head = params.get("lm_head")
    dtype = jax.tree_util.tree_leaves(params["heads"])[0].dtype
    out = []
    for s in range(0, len(labels), chunk):
        x, lab = feats[s : s + chunk], labels[s : s + chunk]
        if len(x) < chunk:  # one compiled shape
            x = np.concatenate([x, np.zeros((chunk - len(x),) + x.shape[1:], x.dtype)])
            lab = np.concatenate([lab, np.full((chunk - len(lab), k), -1)])
        r = _label_ranks(proposer, params["heads"], lm_head, jnp.asarray(x, dtype), jnp.asarray(lab, jnp.int32))
        out.append(np.asarray(r)[: len(labels) - s])
    return np.concatenate(out), offsets


def prefix_counts(ranks: np.ndarray, max_rank: int) -> collections.Counter:
    """How many positions' true rank paths start with each prefix of ranks < max_rank."""
    counts: collections.Counter = collections.Counter()
    for row in ranks:
        path = []
        for r in row:
            if r < 0 or r >= max_rank:
                break
            path.append(int(r))
            counts[tuple(path)] += 1
    return counts


def fit_tree(counts: collections.Counter, num_nodes: int) -> list[tuple[int, ...]]:
    """The num_nodes most frequent prefixes, parents before children (ties: shorter, then lower
    ranks first, so a chosen node's parent is always chosen)."""
    order = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    return order[:num_nodes]


def expected_accepted(counts: collections.Counter, num_positions: int, choices) -> float:
    """Mean tokens per step (accepted drafts + the target's own) a tree would give on these
    positions; choices must hold every node's path (a prefix-closed tree)."""
    return 1.0 + sum(counts.get(tuple(p), 0) for p in choices) / num_positions


def decoded_tokens_per_step(ranks: np.ndarray, offsets: np.ndarray, choices, max_rank: int) -> float:
    """Tokens per target pass greedy decoding would take over these answers with this tree.

    Each step starts where the previous one's accepted tokens end, so steps land on the
    positions the heads get wrong more often than a mean over all positions weighs them (this
    comes out below `expected_accepted`)."""
    tree = {tuple(p) for p in choices}
    tokens = steps = 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        i = a
        while i < b:
            n = accepted_drafts(ranks[i], tree, max_rank)
            steps += 1
            tokens += n + 1
            i += n + 1
    return tokens / max(steps, 1)


def accepted_drafts(row, tree: set, max_rank: int) -> int:
    """Drafted tokens a step accepts when the true tokens have these ranks: the depth of the
    deepest tree node on their path."""
    n = 0
    while n < len(row) and 0 <= row[n] < max_rank and tuple(int(r) for r in row[: n + 1]) in tree:
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", required=True, help="specjax Medusa head checkpoint")
    ap.add_argument(
        "--data",
        required=True,
        help="a data folder of `specjax train` (its final-state features) or a feature folder itself",
    )
    ap.add_argument("--base", default="smollm2-135m", help="the heads' base model")
    ap.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=[4, 8, 16, 32, 63],
        help="tree sizes to fit (drafted nodes, the root not counted)",
    )
    ap.add_argument("--max-rank", type=int, default=10, help="ranks per head considered")
    ap.add_argument("--sequences", type=int, default=500, help="sequences of the data read")
    ap.add_argument("--out", default=None, help="write the trees and estimates to this JSON")
    args = ap.parse_args(argv)
    try:
        result = fit_trees(args.heads, args.data, args.base, args.nodes, args.max_rank, args.sequences)
    except (ValueError, OSError) as e:
        print(f"medusa_tree: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{result['positions']} positions of {result['sequences']} answers; tokens per target "
        f"pass: mean over positions / greedy decoding of the answers"
    )
    for n, tree in {**result["trees"], **result["reference"]}.items():
        print(f"{n:>12}: {tree['expected_accepted']:.3f} / {tree['decoded']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"trees written to {args.out}")
    return 0


def find_final_features(data) -> Path:
    """The feature folder with final hidden states in a data folder (or data itself)."""
    from specjax.training.features import FEATURES_DIR

    data = Path(data)
    if (data / "meta.json").exists():
        return data
    found = sorted(
        p.parent for p in (data / FEATURES_DIR).glob("*/meta.json") if json.loads(p.read_text()).get("final")
    )
    if not found:
        raise ValueError(
            f"{data} holds no final-state features: extract them with "
            f"`specjax train --method medusa --data {data} --until features`"
        )
    return min(found, key=lambda p: len(p.name))  # final-only rather than EAGLE-3's


def fit_trees(heads, data, base="smollm2-135m", nodes=(4, 8, 16, 32, 63), max_rank=10, sequences=500) -> dict:
    """{"positions", "trees": {n: {"choices", "expected_accepted", "decoded"}}, "reference":
    the same for the named trees}."""
    from specjax.loading import load_model
    from specjax.methods import make_proposer
    from specjax.proposers.medusa import MEDUSA_TREES
    from specjax.training.features import FeatureStore

    if any(n < 1 for n in nodes) or max_rank < 1:
        raise ValueError("--nodes and --max-rank must be >= 1")
    store = FeatureStore(find_final_features(data))
    model = load_model(base, pack=False)
    if store.hidden_size != model.config.hidden_size:
        raise ValueError(
            f"features of hidden size {store.hidden_size} do not match the base model's {model.config.hidden_size}"
        )
    proposer, params = make_proposer("medusa", model, heads=str(heads), medusa_choices=[[0]])
    ranks, offsets = true_ranks(proposer, params, store, sequences)
    counts = prefix_counts(ranks, max_rank)

    def scores(choices):
        return {
            "choices": [list(p) for p in choices],
            "expected_accepted": expected_accepted(counts, len(ranks), choices),
            "decoded": decoded_tokens_per_step(ranks, offsets, choices, max_rank),
        }

    trees = {str(n): scores(fit_tree(counts, n)) for n in nodes}
    reference = {name: scores([p for p in tree if len(p) <= proposer.num_heads]) for name, tree in MEDUSA_TREES.items()}
    top1 = [float(np.mean(ranks[:, j] == 0)) for j in range(ranks.shape[1])]
    return {
        "heads": str(heads),
        "features": str(store.root),
        "positions": int(len(ranks)),
        "sequences": min(sequences, len(store)),
        "max_rank": max_rank,
        "top1_per_head": top1,
        "trees": trees,
        "reference": reference,
    }


if __name__ == "__main__":
    sys.exit(main())
