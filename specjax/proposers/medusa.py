"""Medusa: K extra decoding heads on the target's last hidden state draft a static token tree.

Head k (ResBlocks x + SiLU(W x + b), then a vocabulary projection: its own or the target's
`lm_head`) reads the final hidden state of the token that predicted the pending token and
proposes the token k + 1 places after the pending one. `medusa_choices` lists the tree's nodes as
paths of top-k ranks, one rank per head (FasterDecoding/Medusa's format); TensorRT-LLM also takes
only the leaf paths, which `expand_choices` completes. Node i at depth d holds the rank[i]-th most
likely token of head d - 1. Verification is lossless with the tree `match` rule. When sampling
under the `recursive` rule, rank r is instead head d - 1's r-th draw without replacement from
its (processed) distribution q, the same draws under every parent of that depth: a node's
children are then its first draws, made independently of how the walk reached it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.draft_tree import (
    DRAWN_RULES,
    TREE_RULES,
    check_confidence_floor,
    check_recursive_tree,
    drawn_static_tree,
    on_vocabulary,
    one_parent_per_depth,
    reaches_floor,
    static_draft_tree,
    static_tree,
)
from specjax.model import head_logits
from specjax.sampling import gumbel_top_k, processed_logprobs
from specjax.spec_decode import ProposerBase

# FasterDecoding/Medusa's default tree for 7B models: 63 nodes, depth 4, ranks up to 9.
MC_SIM_7B_63 = (
    (0,),
    (0, 0),
    (1,),
    (0, 1),
    (2,),
    (0, 0, 0),
    (1, 0),
    (0, 2),
    (3,),
    (0, 3),
    (4,),
    (0, 4),
    (2, 0),
    (0, 5),
    (0, 0, 1),
    (5,),
    (0, 6),
    (6,),
    (0, 7),
    (0, 1, 0),
    (1, 1),
    (7,),
    (0, 8),
    (0, 0, 2),
    (3, 0),
    (0, 9),
    (8,),
    (9,),
    (1, 0, 0),
    (0, 2, 0),
    (1, 2),
    (0, 0, 3),
    (4, 0),
    (2, 1),
    (0, 0, 4),
    (0, 0, 5),
    (0, 0, 0, 0),
    (0, 1, 1),
    (0, 0, 6),
    (0, 3, 0),
    (5, 0),
    (1, 3),
    (0, 0, 7),
    (0, 0, 8),
    (0, 0, 9),
    (6, 0),
    (0, 4, 0),
    (1, 4),
    (7, 0),
    (0, 1, 2),
    (2, 0, 0),
    (3, 1),
    (2, 2),
    (8, 0),
    (0, 5, 0),
    (1, 5),
    (1, 0, 1),
    (0, 2, 1),
    (9, 0),
    (0, 6, 0),
    (0, 0, 0, 1),
    (1, 6),
    (0, 7, 0),
)
# Trees `medusa_choices` may name (`--medusa-choices mc_sim_7b_63`).
MEDUSA_TREES = {"mc_sim_7b_63": MC_SIM_7B_63}


def expand_choices(choices: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """All nodes of a tree given either every node's path or only the leaves' paths."""
    nodes = set()
    for path in choices:
        path = tuple(int(r) for r in path)
        if not path or any(r < 0 for r in path):
            raise ValueError(f"medusa choice {list(path)} must be a non-empty list of ranks >= 0")
        for d in range(1, len(path) + 1):
            nodes.add(path[:d])
    return tuple(sorted(nodes, key=lambda p: (len(p), p)))


class ResBlock(nn.Module):
    """x + SiLU(W x + b), starting as the identity (W = 0) as in Medusa."""

    features: int

    @nn.compact
    def __call__(self, x):
        return x + nn.silu(nn.Dense(self.features, kernel_init=nn.initializers.zeros)(x))


class MedusaHead(nn.Module):
    num_layers: int
    vocab_size: int
    own_lm_head: bool = True

    @nn.compact
    def __call__(self, x):
        """Logits with its own projection, else the hidden state for the shared one."""
        for _ in range(self.num_layers):
            x = ResBlock(x.shape[-1])(x)
        if self.own_lm_head:
            return nn.Dense(self.vocab_size, use_bias=False)(x)
        return x


class MedusaHeads(nn.Module):
    """All heads: features [B, D] -> logits [B, num_heads, V].

    Heads sharing the base's `lm_head` [V', D] (V' = V, or the rows of a draft vocabulary) go
    through it in one product: the weight is read once for all heads, which is what a
    memory-bound CPU or GPU step pays for.
    """

    num_heads: int = 4
    num_layers: int = 1
    vocab_size: int = 32000
    own_lm_head: bool = True

    @nn.compact
    def __call__(self, features, base_lm_head=None):
        out = jnp.stack(
            [
                MedusaHead(self.num_layers, self.vocab_size, self.own_lm_head, name=f"head_{k}")(features)
                for k in range(self.num_heads)
            ],
            axis=-2,
        )
        if self.own_lm_head:
            return out
        return head_logits(out, base_lm_head)


@dataclasses.dataclass(frozen=True)
class MedusaProposer(ProposerBase):
    """Medusa drafting over a static `medusa_choices` tree (TensorRT-LLM's names)."""

    num_heads: int = 4
    num_layers: int = 1
    vocab_size: int = 32000
    medusa_choices: tuple = MC_SIM_7B_63
    own_lm_head: bool = True
    # Typical acceptance (lossy; Medusa's defaults 0.09 and 0.3) when posterior_threshold is set.
    posterior_threshold: float | None = None
    posterior_alpha: float = 0.3
    # Verify only nodes whose cumulative head probability (the product over the path of each
    # head's softmax) is at least this, in top-k trees (greedy, `match`): see EAGLE's min_prob.
    min_prob: float = 0.0
    # The lossless rule when sampling: "match" (top-k trees), "recursive" or "traversal"
    # (drawn trees; traversal where each depth's nodes share one parent).
    acceptance: str = "match"
    is_chain: bool = False

    @property
    def rule(self) -> str:
        return self.acceptance if self.posterior_threshold is None else "typical"

    @property
    def rules(self) -> tuple[str, ...]:
        return TREE_RULES if self.posterior_threshold is None else ("typical",)

    @property
    def rule_options(self) -> dict:
        if self.posterior_threshold is None:
            return {}
        return {"posterior_threshold": self.posterior_threshold, "posterior_alpha": self.posterior_alpha}

    def __post_init__(self):
        nodes = expand_choices(self.medusa_choices)
        object.__setattr__(self, "medusa_choices", nodes)
        if self.posterior_threshold is not None and not (
            0 < self.posterior_threshold <= 1 and 0 < self.posterior_alpha <= 1
        ):
            raise ValueError("posterior_threshold and posterior_alpha must be in (0, 1]")
        check_confidence_floor(self.min_prob)
        if self.acceptance not in TREE_RULES:
            raise ValueError(f"Medusa verifies with the match, recursive or traversal rule, not {self.acceptance!r}")
        if self.acceptance in DRAWN_RULES:
            if self.posterior_threshold is not None:
                raise ValueError(
                    f"typical acceptance (posterior_threshold) replaces the {self.acceptance} rule: give one of them"
                )
            check_recursive_tree(nodes)
        if self.acceptance == "traversal" and not one_parent_per_depth(nodes):
            raise ValueError(
                "traversal acceptance needs each depth of medusa_choices under one "
                "parent: a Medusa head's draws are shared by a depth's parents"
            )
        if max(len(p) for p in nodes) > self.num_heads:
            raise ValueError(
                f"medusa_choices is {max(len(p) for p in nodes)} deep but there are only {self.num_heads} Medusa heads"
            )

    @property
    def heads(self) -> MedusaHeads:
        return MedusaHeads(self.num_heads, self.num_layers, self.vocab_size, self.own_lm_head)

    @property
    def tree_size(self) -> int:
        return len(self.medusa_choices) + 1

    @property
    def top_k(self) -> int:
        return max(max(p) for p in self.medusa_choices) + 1

    def init_params(self, key, hidden_size: int, base_lm_head=None):
        """Random head parameters (ResBlocks start as the identity)."""
        x = jnp.zeros((1, hidden_size), jnp.float32)
        return self.heads.init(key, x, base_lm_head)

    propose_may_be_skipped = True  # the heads keep no state

    def make_pools(self, num_pages, page_size, dtype):
        return None

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        return ()

    def propose(self, params, state, ctx, keys, sampling):
        """params: {"heads": flax variables, "lm_head": [V, D] when the heads share the base's,
        or its rows of frequent tokens with "draft_ids" [V'] their target ids}."""
        topology = static_tree(self.medusa_choices)
        parent, depth, rank = (jnp.asarray(a) for a in topology)
        b = ctx.tokens.shape[0]
        # Only the heads the tree reaches run (each ends in a [V, D] projection, a large part of
        # a CPU step); flax ignores the variables of the others.
        used = max(len(p) for p in self.medusa_choices)
        heads = MedusaHeads(used, self.num_layers, self.vocab_size, self.own_lm_head)
        logits = heads.apply(params["heads"], ctx.hidden.astype(jnp.float32), params.get("lm_head"))  # [B, used, V]
        head = jnp.clip(depth - 1, 0, used - 1)
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        if self.rule in DRAWN_RULES and not sampling.greedy:
            logq = processed_logprobs(logits, sampling)  # [B, used, V']
            ids, drawn = gumbel_top_k(
                jax.vmap(lambda k: jax.random.split(k, used))(keys), logq, self.top_k
            )  # [B, used, K] each head's draws
            to_target = params.get("draft_ids")
            if to_target is not None:
                logq, ids = on_vocabulary(logq, to_target, self.vocab_size), to_target[ids]
            pick = (slice(None), head[1:], rank[1:])
            return drawn_static_tree(
                pending, *topology[:2], ids[pick], drawn[pick] > -jnp.inf, logq[:, head[1:]]
            ), state
        top_logits, top = jax.lax.top_k(logits, self.top_k)  # [B, used, K]
        top = top.astype(jnp.int32)
        if "draft_ids" in params:  # lm_head holds only these target ids' rows
            top = params["draft_ids"][top]
        drafted = top[:, head, rank]  # [B, T]
        tokens = drafted.at[:, 0].set(pending)
        t = self.tree_size
        valid = jnp.ones((b, t), bool)
        if self.min_prob > 0:
            logp = top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
            node_logp = jnp.where(depth > 0, logp[:, head, rank], 0.0)  # [B, T]
            score = node_logp  # cumulative over the path, depth by depth
            par_np, dep_np, _ = topology
            for d in range(2, int(dep_np.max()) + 1):
                nodes = np.flatnonzero(dep_np == d)
                score = score.at[:, nodes].add(score[:, par_np[nodes]])
            valid = reaches_floor(score, self.min_prob)
        return static_draft_tree(tokens, *topology[:2], valid), state

    def update(self, params, state, ctx, result, active):
        return state

    def pools_of(self, state):
        return None
