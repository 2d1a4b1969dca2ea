"""Acceptance: which drafted nodes the target keeps, and the token it adds after them.

Lossless rules (docs/design.md, "Acceptance, and why each rule is lossless"):
- `match` (greedy, deterministic trees, chains with use_logits=False): draw y_i from the target's
  (processed) distribution at every node, or take its argmax when greedy; walk from the root into
  the child whose token equals the parent's y. For deterministic candidates this is exactly the
  sibling-rejection rule (accept x with p(x), else set p(x) = 0 and renormalize): the first
  sibling is accepted with p(x1), the second with (1 - p(x1)) p(x2) / (1 - p(x1)) = p(x2), and so
  on, and when none is accepted the draw is the renormalized remainder.
- `residual` (chains drafted by sampling from q, use_logits=True): accept x with
  min(1, p(x) / q(x)); on rejection draw from norm(max(0, p - q)); a bonus draw from p when every
  draft is accepted (Leviathan et al., Chen et al.).
- `recursive` (trees whose siblings were drawn one after another without replacement from q,
  Jeon et al. 2024, "Recursive Speculative Decoding"): at the current node, with p' = p there and
  q' = q, try the children in draw order: accept c with min(1, p'(c) / q'(c)) and move into it;
  on rejection p' <- norm(max(0, p' - q')) and q' <- q' without c, renormalized; when every child
  is rejected draw from p', and at a leaf draw the bonus from p. Each try is a speculative-sampling
  step of target p' with a proposal q' that is exactly the distribution of that child given the
  earlier ones. By induction on the siblings left, what follows a rejection outputs
  norm(max(0, p' - q')) whatever was rejected, so each try outputs min(p', q') + max(0, p' - q')
  = p', and the first outputs p.
- `traversal` (the same drawn trees, Weng et al. 2025, "Traversal Verification"): nodes tried
  leaves first, each with the weight of its whole root path; a path is accepted at least as
  often as under `recursive` (`accept_traversal` has the proof). It needs subtrees drawn apart
  from each other (a subtree's shape must not depend on a sibling subtree's draws).

Lossy by design, offered because Medusa offers it: `typical` acceptance keeps a drafted token x
when p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))) at its parent, follows the
deepest such path, then draws the next token from p. Its output distribution is NOT the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.attention import on_cpu_path
from specjax.draft_tree import DraftTree, ancestor_mask
from specjax.sampling import SamplingConfig, argmax_last, categorical, processed_logprobs


@struct.dataclass
class AcceptResult:
    """Per sequence: the accepted root path, its length, and the token the target adds."""

    path: jax.Array  # int32[B, T]: path[b, d] = node at depth d, for d <= n_accepted[b]
    n_accepted: jax.Array  # int32[B]: drafted tokens accepted (the root is not counted)
    next_token: jax.Array  # int32[B]: correction or bonus token, the next pending token


def _node_keys(keys, t: int):
    """[B, T] keys: one per node of each sequence's tree, for the target's draw there."""
    return jax.vmap(lambda k: jax.random.split(k, t))(keys)


def _node_draws(logits, keys, sampling: SamplingConfig, logp=None):
    """One target draw per node: argmax when greedy, else a sample from the processed p
    (logp: processed_logprobs(logits) when the caller has it already)."""
    if sampling.greedy:
        return argmax_last(logits)
    node_keys = _node_keys(keys, logits.shape[1])
    if logp is None:
        logp = processed_logprobs(logits, sampling)
    return jax.vmap(jax.vmap(categorical))(node_keys, logp)


def acceptable_nodes(tree: DraftTree):
    """bool[B, T]: valid nodes that acceptance may follow (see DraftTree.acceptable)."""
    return tree.valid if tree.acceptable is None else tree.valid & tree.acceptable


def _path_to(tree: DraftTree, best):
    """int32[B, T]: nodes on the root path to `best`, indexed by depth (zeros past it)."""
    b, t = tree.tokens.shape
    on = ancestor_mask(tree)[jnp.arange(b), best]  # [B, T]
    depth_onehot = (tree.depth[:, :, None] == jnp.arange(t)[None, None, :]) & on[:, :, None]
    return jnp.einsum("bjd,j->bd", depth_onehot.astype(jnp.int32), jnp.arange(t, dtype=jnp.int32))


def _follow(tree: DraftTree, ok, draws) -> AcceptResult:
    """Accept the deepest node whose whole root path is `ok`; the next token is its draw."""
    b, t = tree.tokens.shape
    parent = jnp.clip(tree.parent, 0, t - 1)

    def walk(i, on):  # parents precede children, so one pass in index order suffices
        return on.at[:, i].set(ok[:, i] & on[jnp.arange(b), parent[:, i]])

    on_path = jax.lax.fori_loop(1, t, walk, jnp.zeros((b, t), bool).at[:, 0].set(True))
    best = jnp.argmax(jnp.where(on_path, tree.depth, -1), axis=1)
    n = jnp.take_along_axis(tree.depth, best[:, None], axis=1)[:, 0]
    nxt = jnp.take_along_axis(draws, best[:, None], axis=1)[:, 0]
    return AcceptResult(_path_to(tree, best), n.astype(jnp.int32), nxt)


def accept_match(tree: DraftTree, logits, keys, sampling: SamplingConfig) -> AcceptResult:
    """The `match` rule over any tree (greedy when sampling.greedy); keys: one per sequence."""
    if sampling.greedy or not on_cpu_path():
        return accept_draws(tree, _node_draws(logits, keys, sampling))
    return _walk_match(tree, logits, keys, sampling)


def _walk_match(tree: DraftTree, logits, keys, sampling: SamplingConfig) -> AcceptResult:
    """The `match` rule when sampling on XLA:CPU: the draws of _node_draws, made only at the root
    and the nodes matched (a draw costs a log-softmax over the vocabulary, and with top-p 32
    passes more); one pass in index order takes the first acceptable child of the current node
    whose token is the current draw, as accept_draws' first-of-equal-siblings does."""
    b, t = tree.tokens.shape
    node_keys = _node_keys(keys, t)
    ok = acceptable_nodes(tree)

    def draw(j):
        return jax.vmap(categorical)(node_keys[:, j], processed_logprobs(logits[:, j], sampling))

    def try_node(j, carry):
        cur, y = carry
        take = ok[:, j] & (tree.parent[:, j] == cur) & (tree.tokens[:, j] == y)
        return _only_if(jnp.any(take), lambda c: (jnp.where(take, j, c[0]), jnp.where(take, draw(j), c[1])), carry)

    cur, y = jax.lax.fori_loop(1, t, try_node, (jnp.zeros((b,), jnp.int32), draw(0)))
    return AcceptResult(_path_to(tree, cur), tree.depth[jnp.arange(b), cur].astype(jnp.int32), y)


def accept_draws(tree: DraftTree, y) -> AcceptResult:
    """The `match` rule given the target's draw y int32[B, T] at every node (its argmax when
    greedy: `verify_pruned_kv(..., greedy_draws=True)` returns them)."""
    b, t = tree.tokens.shape
    parent = jnp.clip(tree.parent, 0, t - 1)
    parent_y = jnp.take_along_axis(y, parent, axis=1)
    ok = acceptable_nodes(tree)
    match = ok & (tree.parent >= 0) & (tree.tokens == parent_y)
    # Among (acceptable) siblings holding the same token only the first may be followed.
    same = (
        (tree.parent[:, :, None] == tree.parent[:, None, :])
        & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
        & ok[:, None, :]
    )
    earlier = jnp.tril(jnp.ones((t, t), bool), k=-1)[None]
    match = match & ~jnp.any(same & earlier, axis=2)
    return _follow(tree, match, y)


def _normalized(w, fallback):
    """w [B, V] over its sum, or `fallback` for rows without mass (numerically only)."""
    mass = jnp.sum(w, axis=-1, keepdims=True)
    return jnp.where(mass > 0, w / jnp.where(mass > 0, mass, 1.0), fallback)


def accept_residual(tree: DraftTree, logits, keys, sampling: SamplingConfig) -> AcceptResult:
    """The `residual` rule over chains whose node i was drawn from q = draft_logprobs[:, i]."""
    if tree.draft_logprobs is None:
        raise ValueError("residual acceptance needs the draft's probabilities (draft_logprobs)")
    if tree.acceptable is not None:
        raise ValueError("residual acceptance walks chains: it takes no `acceptable` mask")
    b, t = tree.tokens.shape
    split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)
    k_u, k_res = split[:, 0], split[:, 1]
    logp = processed_logprobs(logits, sampling)  # target p at each node  [B, T, V]
    logq = tree.draft_logprobs  # q that drew node i (at node i - 1)  [B, T, V]
    x = tree.tokens
    p_x = jnp.take_along_axis(logp[:, :-1], x[:, 1:, None], axis=2)[..., 0]  # p_{i-1}(x_i)
    q_x = jnp.take_along_axis(logq[:, 1:], x[:, 1:, None], axis=2)[..., 0]  # q_i(x_i)
    u = jax.vmap(lambda k: jax.random.uniform(k, (t - 1,)))(k_u)
    ok = tree.valid[:, 1:] & (jnp.log(u) < p_x - q_x)
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(b)
    p_n = jnp.exp(logp[rows, n])
    # Stopped at a rejected draft: sample the residual; ran out of drafts: sample p (the bonus).
    rejected = jnp.take_along_axis(tree.valid, jnp.minimum(n + 1, t - 1)[:, None], 1)[:, 0] & (n + 1 < t)
    q_next = jnp.exp(logq[rows, jnp.minimum(n + 1, t - 1)])
    dist = jnp.where(rejected[:, None], _normalized(jnp.maximum(p_n - q_next, 0.0), p_n), p_n)
    nxt = jax.vmap(lambda k, d: categorical(k, jnp.log(d)))(k_res, dist)
    path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return AcceptResult(path, n, nxt)


def _after_rejection(p, q, x, p_node):
    """(p', q') [B, V] after the draft x [B] is rejected: the residual norm(max(0, p - q)) (p at
    the node if it has no mass), and q without x renormalized, the next sibling's distribution."""
    drawn = jnp.arange(q.shape[-1])[None, :] == x[:, None]
    return (_normalized(jnp.maximum(p - q, 0.0), p_node), _normalized(jnp.where(drawn, 0.0, q), jnp.zeros_like(q)))


def _only_if(pred, body, carry):
    """body(carry) if pred else carry, for a body that leaves carry as it is when it has nothing
    to do. The skip pays on XLA:CPU (a node's [B, V] work over a whole vocabulary); a GPU program
    runs the body, cheaper there than a conditional's device-to-host read of pred."""
    if not on_cpu_path():
        return body(carry)
    return jax.lax.cond(pred, body, lambda c: c, carry)


def _target_probs(logits, sampling: SamplingConfig):
    """The target's p [..., V] after the request's temperature, top-k and top-p."""
    return jnp.exp(processed_logprobs(logits, sampling))


def _drawn_tree_inputs(rule: str, tree: DraftTree, keys):
    """What the rules over drawn trees start from, after refusing trees they cannot walk: one
    uniform [B, T] per node (or try) and a key [B] for the next token."""
    if tree.draft_logprobs is None:
        raise ValueError(f"{rule} acceptance needs the draft's probabilities (draft_logprobs)")
    if tree.acceptable is not None:
        raise ValueError(f"{rule} acceptance walks draft trees: it takes no `acceptable` mask")
    split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)
    u = jax.vmap(lambda k: jax.random.uniform(k, (tree.size,)))(split[:, 0])
    return u, split[:, 1]


def accept_recursive(tree: DraftTree, logits, keys, sampling: SamplingConfig) -> AcceptResult:
    """The `recursive` rule (module docstring) over trees whose siblings, in index order, were
    drawn one after another without replacement from q = draft_logprobs (a prefix of the draws).

    One pass in index order: node j is tried iff it is valid and its parent is the current node
    (the children of an accepted node come later; the later siblings of one are then skipped).
    A sibling whose q row differs from the one its earlier siblings were drawn from starts a new
    group of draws, tried from its own q against the residual p' left so far: a deterministic
    candidate (the lookup graft's, q one-hot) tried after the drafted ones is such a group.
    On XLA:CPU the target's p is computed only at the root and the nodes accepted (a row of
    exp(log_softmax) over the vocabulary costs there as much as a tried node's other work); a
    GPU program computes it for all nodes in one batch.
    """
    u, next_keys = _drawn_tree_inputs("recursive", tree, keys)
    b, t = tree.tokens.shape
    rows = jnp.arange(b)
    p_all = None if on_cpu_path() else _target_probs(logits, sampling)

    def p_at(j):
        return _target_probs(logits[:, j], sampling) if p_all is None else p_all[:, j]

    logq = tree.draft_logprobs

    def try_node(j, carry):  # carry: current node, p', q', the node q' was read from, fresh
        cur = carry[0]
        tried = tree.valid[:, j] & (tree.parent[:, j] == cur)
        # Most nodes of a tree are never tried (a rejected node's subtree, an accepted one's
        # later siblings): their [B, V] work is skipped when no row tries the node.
        return _only_if(jnp.any(tried), lambda c: try_tried(j, tried, c), carry)

    def try_tried(j, tried, carry):
        cur, p_c, q_c, src, fresh = carry
        new = fresh | jnp.any(logq[:, j] != logq[rows, src], axis=-1)  # a new group of draws
        q = jnp.where(new[:, None], jnp.exp(logq[:, j].astype(jnp.float32)), q_c)
        x = tree.tokens[:, j]
        ok = u[:, j] * q[rows, x] < p_c[rows, x]  # probability min(1, p'(x) / q'(x))
        # (p' itself stands in for a residual without mass: a rejection with probability 0)
        p_rej, q_rej = _after_rejection(p_c, q, x, p_c)
        take, drop = tried & ok, tried & ~ok
        p_c = jnp.where(drop[:, None], p_rej, p_c)
        q_c = jnp.where(drop[:, None], q_rej, q_c)
        src = jnp.where(drop & new, j, src)
        carry = jnp.where(take, j, cur), p_c, q_c, src, jnp.where(tried, take, fresh)
        return _only_if(
            jnp.any(take),
            lambda c: (  # p' at an accepted node: p there
                c[0],
                jnp.where(take[:, None], p_at(j), c[1]),
                *c[2:],
            ),
            carry,
        )

    zero = jnp.zeros((b,), jnp.int32)
    p_root = p_at(0)
    init = (zero, p_root, jnp.zeros_like(p_root), zero, jnp.ones((b,), bool))
    cur, p_c, *_ = jax.lax.fori_loop(1, t, try_node, init)
    # p' is the residual after rejected children, or p at a leaf (the bonus).
    nxt = jax.vmap(categorical)(next_keys, jnp.log(p_c))
    return AcceptResult(_path_to(tree, cur), tree.depth[rows, cur].astype(jnp.int32), nxt)


def _earlier_siblings(tree: DraftTree):
    """bool[B, T, T]: [b, j, k] iff k < j and nodes j and k share a parent."""
    t = tree.size
    earlier = jnp.tril(jnp.ones((t, t), bool), k=-1)[None]
    return (tree.parent[:, :, None] == tree.parent[:, None, :]) & earlier


def _sibling_groups(tree: DraftTree):
    """bool[B, T]: node j continues the draws of its previous valid sibling (same q row), so
    after that sibling's rejection it is a draw from q without the rejected tokens."""
    t = tree.size
    sib = _earlier_siblings(tree) & tree.valid[:, None, :] & (tree.parent[:, :, None] >= 0)
    prev = jnp.argmax(jnp.where(sib, jnp.arange(t)[None, None, :], -1), axis=2)
    logq = tree.draft_logprobs
    prev_q = jnp.take_along_axis(logq, prev[:, :, None], axis=1)
    return jnp.any(sib, axis=2) & jnp.all(logq == prev_q, axis=-1)


def _path_log_weights(tree: DraftTree, anc, log_ratio, log_w_set, was_set):
    """float32[B, T]: log of each node's acceptance weight w(j) = min(1, w(parent) r(j)), or the
    weight set at the node when one of its children was rejected (the root's is 1 until then).
    x_d = min(0, x_{d-1} + l_d) from x_s is min(x_s + sum_{s<i<=d} l_i, min_{s<k<=d} sum_{k<i<=d}
    l_i), so with C the cumulative log-ratio along each root path and s the deepest node with a
    set weight, every node's weight comes from one [B, T, T] reduction."""
    b, t = tree.tokens.shape
    cum = jnp.einsum("bjm,bm->bj", anc.astype(jnp.float32), log_ratio)  # C(j)
    anchored = anc & (was_set | (jnp.arange(t) == 0))[:, None, :]
    depth_s = jnp.max(jnp.where(anchored, tree.depth[:, None, :], -1), axis=2)  # [B, T]
    base = jnp.where(was_set, log_w_set, 0.0)
    at_s = tree.depth[:, None, :] == depth_s[:, :, None]
    term = cum[:, :, None] - cum[:, None, :] + jnp.where(at_s, base[:, None, :], 0.0)
    usable = anc & (tree.depth[:, None, :] >= depth_s[:, :, None])
    return jnp.min(jnp.where(usable, term, jnp.inf), axis=2)


def _weight_after_rejection(mass, a):
    """The weight h = S / (S + 1 - a) a node of weight a keeps when a child is rejected, S the
    mass of max(0, a p' - q') (1 where S + 1 - a = 0: a state reached with probability 0)."""
    return jnp.where(mass + 1.0 - a > 0, mass / jnp.maximum(mass + 1.0 - a, 1e-30), 1.0)


def accept_traversal(tree: DraftTree, logits, keys, sampling: SamplingConfig) -> AcceptResult:
    """The `traversal` rule (Weng et al. 2025, "Traversal Verification"): over the same drawn
    trees as `recursive`, leaves first.

    The nodes are tried in post-order (a node after its whole subtree). Node j carries the
    weight w(j) = min(1, w(parent) p'(j) / q'(j)) of its root path, with p' and q' its parent's
    current target and draft distributions; the tried node (a leaf of what is left) is accepted
    with probability w, with its whole root path. On rejection it is deleted and its parent X,
    of weight a, takes p' <- norm(max(0, a p' - q')), q' <- q' without the node, and the weight
    h = S / (S + 1 - a), S = sum(max(0, a p' - q')); X's later children (and their subtrees)
    then weigh against these. The next token comes from the accepted node's p' (p at a leaf: the
    bonus). Block verification (Sun et al. 2024) is the chain case.

    Why it is exact: a subtree entered with weight w is left through its root with probability
    w, the next token then following the target (by induction on the children left: the first
    child's subtree is left through the child with min(q', w p'), the rejections leave mass
    S + 1 - w, and with weight h the rest leaves h (S + 1 - w) = S of it as norm(max(0, w p' -
    q')): w p' in all). The root enters with 1. This needs every subtree to be drawn from its own
    root's draws, its root path and its elder siblings' tokens alone: a subtree whose shape
    depends on a sibling subtree's draws (EAGLE-2's beams wider than one node past depth 1, or
    Medusa's draws shared by the parents of a depth) is not verified exactly by it.
    A path accepted by `recursive` is accepted here too with at least that probability, since
    min(1, a r) >= min(1, a) min(1, r).
    """
    u, next_keys = _drawn_tree_inputs("traversal", tree, keys)
    p = _target_probs(logits, sampling)
    b, t = tree.tokens.shape
    rows = jnp.arange(b)
    logq = tree.draft_logprobs
    parent = jnp.clip(tree.parent, 0, t - 1)
    tok = tree.tokens
    anc = ancestor_mask(tree)
    same = _sibling_groups(tree)
    q_own = jnp.exp(jnp.take_along_axis(logq, tok[:, :, None], axis=2)[..., 0].astype(jnp.float32))
    siblings = _earlier_siblings(tree)
    bound = lambda x: jnp.clip(jnp.log(x), -1e4, 1e4)

    def try_leaf(i, carry):  # once every row has accepted a node, the rest is skipped
        return _only_if(~jnp.all(carry[1]), lambda c: try_next(i, c), carry)

    def try_next(i, carry):
        deleted, done, final, p_c, q_c, was_set, w_set = carry
        active = tree.valid & ~deleted
        first = active & ~jnp.any(siblings & active[:, None, :], axis=2)  # first active child
        on_path = jnp.all(~anc | first[:, None, :] | (jnp.arange(t) == 0)[None, None, :], axis=2)
        leaf = jnp.argmax(jnp.where(on_path & active, tree.depth, -1), axis=1)
        p_tok = p_c[rows[:, None], parent, tok]  # p'(j) at j's parent  [B, T]
        q_tok = jnp.where(same, q_c[rows[:, None], parent, tok], q_own)  # q'(j)
        log_ratio = jnp.where(jnp.arange(t) == 0, 0.0, bound(p_tok) - bound(q_tok))
        log_w = _path_log_weights(tree, anc & on_path[:, :, None], log_ratio, jnp.log(w_set), was_set)
        take = ~done & (u[:, i] < jnp.exp(log_w[rows, leaf]))
        drop = ~done & ~take
        x = parent[rows, leaf]  # the rejected leaf's parent
        a = jnp.exp(log_w[rows, x])
        q = jnp.where(same[rows, leaf][:, None], q_c[rows, x], jnp.exp(logq[rows, leaf].astype(jnp.float32)))
        scaled = a[:, None] * p_c[rows, x]
        mass = jnp.sum(jnp.maximum(scaled - q, 0.0), axis=-1)  # S
        h = _weight_after_rejection(mass, a)
        p_rej, q_rej = _after_rejection(scaled, q, tok[rows, leaf], p[rows, x])
        put = lambda arr, val: arr.at[rows, x].set(jnp.where(drop[:, None], val, arr[rows, x]))
        return (
            deleted.at[rows, leaf].set(deleted[rows, leaf] | drop),
            done | take,
            jnp.where(take, leaf, final),
            put(p_c, p_rej),
            put(q_c, q_rej),
            was_set.at[rows, x].set(was_set[rows, x] | drop),
            w_set.at[rows, x].set(jnp.where(drop, h, w_set[rows, x])),
        )

    init = (
        ~tree.valid,
        jnp.zeros((b,), bool),
        jnp.zeros((b,), jnp.int32),
        p,
        jnp.zeros_like(p),
        jnp.zeros((b, t), bool),
        jnp.ones((b, t), jnp.float32),
    )
    _, _, final, p_c, *_ = jax.lax.fori_loop(0, t, try_leaf, init)
    nxt = jax.vmap(categorical)(next_keys, jnp.log(p_c[rows, final]))
    return AcceptResult(_path_to(tree, final), tree.depth[rows, final].astype(jnp.int32), nxt)


def accept_typical(
    tree: DraftTree, logits, keys, sampling: SamplingConfig, posterior_threshold: float, posterior_alpha: float
) -> AcceptResult:
    """Medusa's typical acceptance (lossy): see the module docstring."""
    b, t = tree.tokens.shape
    logp = processed_logprobs(logits, sampling)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # [B, T]
    bar = jnp.minimum(posterior_threshold, posterior_alpha * jnp.exp(-entropy))
    parent = jnp.clip(tree.parent, 0, t - 1)
    p_parent = p[jnp.arange(b)[:, None], parent]  # [B, T, V]: p at each node's parent
    p_tok = jnp.take_along_axis(p_parent, tree.tokens[:, :, None], axis=2)[..., 0]
    ok = acceptable_nodes(tree) & (tree.parent >= 0) & (p_tok > jnp.take_along_axis(bar, parent, axis=1))
    return _follow(tree, ok, _node_draws(logits, keys, sampling, logp))


def accept(
    tree: DraftTree,
    logits,
    keys,
    sampling: SamplingConfig,
    rule: str = "match",
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> AcceptResult:
    """Dispatch on the rule (keys: one PRNG key per sequence); greedy always matches argmax."""
    if sampling.greedy or rule == "match":
        return accept_match(tree, logits, keys, sampling)
    if rule == "residual":
        return accept_residual(tree, logits, keys, sampling)
    if rule == "recursive":
        return accept_recursive(tree, logits, keys, sampling)
    if rule == "traversal":
        return accept_traversal(tree, logits, keys, sampling)
    if rule == "typical":
        return accept_typical(tree, logits, keys, sampling, posterior_threshold, posterior_alpha)
    raise ValueError(f"unknown acceptance rule '{rule}' (match, residual, recursive, traversal or typical)")
