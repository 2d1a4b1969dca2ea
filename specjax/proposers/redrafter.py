"""ReDrafter (Apple's Recurrent Drafter): an RNN over draft tokens plus one LM head, beam search,
and the beams merged into one prefix tree.

The drafter (in apple/ml-recurrent-drafter: its recurrent_drafting/modeling_drafter.py and
docs/drafter.md) reads the target's final normed hidden state h of the token that predicted the
pending token g_0 (`SpecContext.hidden`) and keeps a state per beam:

    s_0 = 0
    s_t = SiLU(W e(g_{t-1}) + U s_{t-1} + b_U)        (rnn=True; rnn_w has no bias, rnn_u has)
    s_t = e(g_{t-1}) + s_{t-1}                         (rnn=False: a running sum of embeddings)
    log P(g_t) = log_softmax(warp(LMHead([h; s_t])))

with e() the target's own token embedding (there is no embedding norm), LMHead = optional
input_proj (2D -> exit_dim, only when exit_dim != 2D), `num_draft_layers` ResBlocks
x + SiLU(W x + b) and a bias-free vocabulary projection, and warp() the reference's top-50
filter (logits shifted by their max, the rest set to -50000). Beam search keeps the
`num_beams` best (beam, token) pairs by cumulative log-probability for `draft_len_per_beam`
steps; step 1 grows beam 0 only (the others start at log 0 = -50000). Beams sharing prefixes
are merged into one DraftTree (TensorRT-LLM's beams-to-tree step), its valid nodes packed first
so that `verify_pruned` can run narrower, verified in one pass and accepted with the tree
`match` rule, which is lossless for any candidate tree because the target's draws do not
depend on the candidates.

TensorRT-LLM (tensorrt_llm/models/redrafter/) drops the SiLU and the first step's U term and
the top-50 warp; specjax follows Apple's reference, the code that trains and saves these
checkpoints (NVIDIA ModelOpt's ReDrafter trainer uses the same SiLU recurrence).
With `greedy_search=False` and a sampling request, beams are extended by sampling without
replacement (Gumbel top-k) from the temperature-scaled cumulative log-probabilities.
Heads trained by specjax may project onto a reduced draft vocabulary (`draft_ids`: the target ids
of the most frequent training tokens, FR-Spec style): the vocabulary projection, the drafter's
largest cost and size, shrinks by V / draft_vocab_size; the target verifies as before.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.cpu.draft_weights import draft_weights
from specjax.cpu.matmul import take_rows
from specjax.draft_tree import DraftTree
from specjax.model import head_logits
from specjax.sampling import kth_largest, per_row
from specjax.spec_decode import ProposerBase

LOG_0 = -50000.0  # the reference's log(0): finite, so sums and top-k stay well defined
KIND = "redrafter"


# ----------------------------------------------------------------------------- drafter network


def init_params(
    key,
    hidden_size: int,
    vocab_size: int,
    *,
    exit_dim: int | None = None,
    num_draft_layers: int = 1,
    rnn: bool = True,
    scale: float = 1.0,
) -> dict:
    """Random drafter parameters (PyTorch Linear's uniform init, times `scale`).

    Layout: linear weights [in, out]; `lm_head` [vocab, exit_dim] like the target's.
    """
    d = hidden_size
    e = 2 * d if exit_dim is None else exit_dim
    keys = iter(jax.random.split(key, 2 * num_draft_layers + 6))

    def lin(n_in, n_out, bias=True):
        bound = scale / math.sqrt(n_in)
        p = {"kernel": jax.random.uniform(next(keys), (n_in, n_out), jnp.float32, -bound, bound)}
        if bias:
            p["bias"] = jax.random.uniform(next(keys), (n_out,), jnp.float32, -bound, bound)
        return p

    params = {
        "resblocks": {str(i): lin(e, e) for i in range(num_draft_layers)},
        "lm_head": lin(e, vocab_size, bias=False)["kernel"].T,
    }
    if e != 2 * d:
        params["input_proj"] = lin(2 * d, e)
    if rnn:
        params["rnn_u"] = lin(d, d)
        params["rnn_w"] = lin(d, d, bias=False)
    return params


def _dense(p, x):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def rnn_step(params, state, emb, rnn: bool):
    """The next recurrent state from the previous one and the embedding of the last token."""
    if rnn:
        return jax.nn.silu(_dense(params["rnn_w"], emb) + _dense(params["rnn_u"], state))
    return emb + state


def drafter_logits(params, hidden, state):
    """Raw drafter logits [..., V] of the target hidden state h and the RNN state s."""
    x = jnp.concatenate([hidden, state], axis=-1)
    if "input_proj" in params:
        x = _dense(params["input_proj"], x)
    blocks = params.get("resblocks", {})
    for i in range(len(blocks)):
        x = x + jax.nn.silu(_dense(blocks[str(i)], x))
    return head_logits(x, params["lm_head"])


def warp_logits(logits, top_k: int | None):
    """The reference's logit processing: shift by the max, keep the top_k, the rest LOG_0."""
    logits = logits - jnp.max(logits, axis=-1, keepdims=True)
    if top_k is None or top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    return jnp.where(logits < kth_largest(logits, top_k), LOG_0, logits)


# ----------------------------------------------------------------------------- beam search


def beam_search(
    params,
    embed,
    hidden,
    init_token,
    *,
    num_beams: int,
    draft_len: int,
    rnn: bool,
    warp_top_k: int | None = 50,
    temperature: float | None = None,
    keys=None,
):
    """Beams [B, W, L] of drafted tokens after init_token, and their log-probabilities [B, W].

    hidden [B, D]: target features; init_token [B]: the pending token; embed [V, D]: the
    target's embedding. temperature/keys (one key per sequence): extend beams by Gumbel top-k
    sampling of the cumulative log-probabilities at that temperature instead of taking the top.
    """
    b, d = hidden.shape
    w, l = num_beams, draft_len
    v = params["lm_head"].shape[0]
    hidden = hidden.astype(jnp.float32)
    ctx = jnp.broadcast_to(hidden[:, None, :], (b, w, d))
    score = jnp.broadcast_to(jnp.asarray([0.0] + [LOG_0] * (w - 1), jnp.float32), (b, w))
    last = jnp.broadcast_to(init_token[:, None].astype(jnp.int32), (b, w))
    beams = jnp.zeros((b, w, l), jnp.int32)
    state = jnp.zeros((b, w, d), jnp.float32)
    rows = jnp.arange(b)[:, None]

    def step(carry, i):
        beams, state, score, last = carry
        state = rnn_step(params, state, take_rows(embed, last).astype(jnp.float32), rnn)
        logits = warp_logits(drafter_logits(params, ctx, state), warp_top_k)  # [B, W, V]
        if temperature is not None:  # one per row [B] or one for all; 0 (a greedy row): as 1
            t = per_row(temperature, logits)
            logits = logits / jnp.where(t == 0, 1.0, t)
        total = (jax.nn.log_softmax(logits, axis=-1) + score[:, :, None]).reshape(b, w * v)
        rank = total
        if keys is not None:
            noise = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, i), (w * v,)))(keys)
            rank = total + noise
        _, idx = jax.lax.top_k(rank, w)
        src, tok = idx // v, (idx % v).astype(jnp.int32)
        if "draft_ids" in params:  # a reduced draft vocabulary: back to target ids
            tok = params["draft_ids"][tok]
        beams = beams[rows, src].at[:, :, i].set(tok)
        return (beams, state[rows, src], jnp.take_along_axis(total, idx, axis=1), tok), None

    (beams, _, score, _), _ = jax.lax.scan(step, (beams, state, score, last), jnp.arange(l))
    return beams, score


def beams_to_tree(init_token, beams) -> DraftTree:
    """One DraftTree per sequence from beams [B, W, L] that all follow init_token [B].

    Node 0 is init_token; node 1 + w * L + d holds beams[w, d]. A node whose prefix (tokens
    0..d) an earlier beam already has is invalid, and its children hang from that earlier
    beam's copy, so each distinct prefix is one valid node and no two valid siblings share a
    token. Parents precede children (the kept copy belongs to an earlier beam).
    """
    b, w, l = beams.shape
    same = beams[:, :, None, :] == beams[:, None, :, :]  # [B, W, W', L]
    shared = jnp.cumprod(same.astype(jnp.int32), axis=-1).astype(bool)  # equal through d
    first = jnp.argmax(shared, axis=2).astype(jnp.int32)  # [B, W, L]: earliest beam with it
    d = jnp.arange(l, dtype=jnp.int32)[None, None, :]
    kept = 1 + first * l + d  # node of the kept copy of each prefix
    parent = jnp.concatenate([jnp.zeros((b, w, 1), jnp.int32), kept[:, :, :-1]], axis=2)
    valid = first == jnp.arange(w, dtype=jnp.int32)[None, :, None]
    flat = lambda x: x.reshape(b, w * l)
    tokens = jnp.concatenate([init_token[:, None].astype(jnp.int32), flat(beams)], axis=1)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), flat(parent)], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), flat(jnp.broadcast_to(d + 1, (b, w, l)))], axis=1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), flat(valid)], axis=1)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, valid=valid)


def compact_tree(tree: DraftTree) -> DraftTree:
    """The same tree with its valid nodes moved to the front (stable order, parents remapped).

    verify_pruned runs only as wide as the last valid node, so merged beams that share
    prefixes cost a narrower verify. Parents still precede children: a valid node's parent is
    valid and keeps its relative order; an invalid node's parent is a kept (valid) copy.
    """
    order = jnp.argsort(~tree.valid, axis=1, stable=True).astype(jnp.int32)  # new -> old
    new_of_old = jnp.argsort(order, axis=1).astype(jnp.int32)
    take = lambda x: jnp.take_along_axis(x, order, axis=1)
    parent = take(tree.parent)
    parent = jnp.where(parent >= 0, jnp.take_along_axis(new_of_old, jnp.maximum(parent, 0), axis=1), -1)
    return DraftTree(tokens=take(tree.tokens), parent=parent, depth=take(tree.depth), valid=take(tree.valid))


# ----------------------------------------------------------------------------- proposer


@dataclasses.dataclass(frozen=True)
class ReDrafterProposer(ProposerBase):
    """ReDrafter drafting (TensorRT-LLM's option names); params: {"drafter", "embed"}.

    Shape fields come from the head checkpoint; exit_dim defaults to 2 * hidden_size.
    """

    hidden_size: int
    vocab_size: int
    exit_dim: int | None = None
    num_draft_layers: int = 1
    rnn: bool = True
    num_beams: int = 5  # redrafter_num_beams
    draft_len_per_beam: int = 5  # redrafter_draft_len_per_beam
    greedy_search: bool = True  # redrafter_greedy_search
    warp_top_k: int | None = 50  # the reference's top-k logit warp in beam search (None: off)
    rule: str = "match"

    def __post_init__(self):
        if self.exit_dim is None:
            object.__setattr__(self, "exit_dim", 2 * self.hidden_size)
        if self.num_beams < 1 or self.draft_len_per_beam < 1:
            raise ValueError(
                f"ReDrafter needs num_beams >= 1 and draft_len_per_beam >= 1, got "
                f"{self.num_beams} and {self.draft_len_per_beam}"
            )
        if self.num_beams > self.vocab_size:
            raise ValueError(f"ReDrafter num_beams {self.num_beams} exceeds the vocabulary ({self.vocab_size})")
        if self.num_draft_layers < 0:
            raise ValueError(f"num_draft_layers must be >= 0, got {self.num_draft_layers}")

    @property
    def tree_size(self) -> int:
        return 1 + self.num_beams * self.draft_len_per_beam

    @property
    def is_chain(self) -> bool:
        """One beam drafts a chain, already in place after verify (commit moves no K/V)."""
        return self.num_beams == 1

    def init_params(self, key, scale: float = 1.0) -> dict:
        return init_params(
            key,
            self.hidden_size,
            self.vocab_size,
            exit_dim=self.exit_dim,
            num_draft_layers=self.num_draft_layers,
            rnn=self.rnn,
            scale=scale,
        )

    def make_pools(self, num_pages, page_size, dtype):
        return None

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        return ()

    def propose(self, params, state, ctx, keys, sampling):
        b = ctx.tokens.shape[0]
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        stochastic = not self.greedy_search and not sampling.greedy
        beams, _ = beam_search(
            params["drafter"],
            params["embed"],
            ctx.hidden,
            pending,
            num_beams=self.num_beams,
            draft_len=self.draft_len_per_beam,
            rnn=self.rnn,
            warp_top_k=self.warp_top_k,
            temperature=sampling.temperature if stochastic else None,
            keys=keys if stochastic else None,
        )
        return compact_tree(beams_to_tree(pending, beams)), state

    def update(self, params, state, ctx, result, active):
        return state

    def pools_of(self, state):
        return None


def head_meta(p: ReDrafterProposer) -> dict:
    """The metadata a specjax ReDrafter head checkpoint stores to rebuild its proposer."""
    return {
        "hidden_size": p.hidden_size,
        "vocab_size": p.vocab_size,
        "exit_dim": p.exit_dim,
        "num_draft_layers": p.num_draft_layers,
        "rnn": p.rnn,
    }


def save_redrafter(out_dir, params: dict, meta: dict):
    """Write drafter parameters as a specjax head checkpoint of kind "redrafter"."""
    from specjax.heads import save_heads

    return save_heads(out_dir, KIND, params, meta)


def load_redrafter(path) -> tuple[dict, dict]:
    """(meta, drafter params) of a specjax ReDrafter head checkpoint, with its shapes checked."""
    from specjax.checkpoint import CheckpointError
    from specjax.heads import load_heads

    meta, params = load_heads(path, KIND)
    missing = [k for k in ("hidden_size", "vocab_size", "num_draft_layers") if k not in meta]
    if missing:
        raise CheckpointError(f"ReDrafter head checkpoint {path} lacks '{missing[0]}' in its metadata")
    d, v = int(meta["hidden_size"]), int(meta["vocab_size"])
    e = int(meta.get("exit_dim") or 2 * d)
    n, rnn = int(meta["num_draft_layers"]), bool(meta.get("rnn", False))
    vd = int(meta.get("draft_vocab_size") or v)
    want = {("lm_head",): (vd, e)}
    if vd != v:  # a reduced draft vocabulary: its target ids, most frequent first
        want[("draft_ids",)] = (vd,)
    want.update({("resblocks", str(i), k): s for i in range(n) for k, s in (("kernel", (e, e)), ("bias", (e,)))})
    if e != 2 * d:
        want.update({("input_proj", "kernel"): (2 * d, e), ("input_proj", "bias"): (e,)})
    if rnn:
        want.update({("rnn_u", "kernel"): (d, d), ("rnn_u", "bias"): (d,), ("rnn_w", "kernel"): (d, d)})
    for keys, shape in want.items():
        node = params
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
            if node is None:
                raise CheckpointError(f"ReDrafter head checkpoint {path} lacks tensor '{'/'.join(keys)}'")
        if tuple(node.shape) != shape:
            raise CheckpointError(
                f"ReDrafter tensor '{'/'.join(keys)}' in {path} has shape {tuple(node.shape)}, expected {shape}"
            )
    if "draft_ids" in params:
        ids = params["draft_ids"]
        if not (jnp.issubdtype(ids.dtype, jnp.integer) and bool(jnp.all((ids >= 0) & (ids < v)))):
            raise CheckpointError(f"ReDrafter draft_ids in {path} must be target token ids < {v}")
        params["draft_ids"] = ids.astype(jnp.int32)
    meta = {
        **meta,
        "hidden_size": d,
        "vocab_size": v,
        "exit_dim": e,
        "num_draft_layers": n,
        "rnn": rnn,
        "draft_vocab_size": vd,
    }
    return meta, params


def make_redrafter(
    target,
    heads,
    *,
    num_beams: int = 5,
    draft_len_per_beam: int = 5,
    greedy_search: bool = True,
    warp_top_k: int | None = 50,
):
    """(ReDrafterProposer, proposer_params) for a loaded target model (`specjax.loading.Model`)
    and a specjax ReDrafter head checkpoint directory `heads`."""
    from specjax.heads import check_compatible

    if heads is None:
        raise ValueError("--method redrafter needs --heads PATH (a specjax ReDrafter head checkpoint)")
    meta, drafter = load_redrafter(heads)
    check_compatible(meta, target.config, heads)
    proposer = ReDrafterProposer(
        hidden_size=meta["hidden_size"],
        vocab_size=meta["vocab_size"],
        exit_dim=meta["exit_dim"],
        num_draft_layers=meta["num_draft_layers"],
        rnn=meta["rnn"],
        num_beams=num_beams,
        draft_len_per_beam=draft_len_per_beam,
        greedy_search=greedy_search,
        warp_top_k=warp_top_k,
    )
    dtype = target.params["embed"].dtype
    drafter = jax.tree_util.tree_map(  # integer id maps keep their type
        lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, drafter
    )
    # the drafter's vocabulary head in the draft weights type on the CPU kernel (its [in, out]
    # layers stay)
    drafter["lm_head"] = draft_weights(drafter["lm_head"])
    return proposer, {"drafter": drafter, "embed": target.params["embed"]}
