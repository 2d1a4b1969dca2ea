"""Loss functions of the draft-head methods, as pure functions of arrays.

Medusa-1 (FasterDecoding/Medusa): head k (0-based) reads the feature of token t and predicts
token t + k + 2 (medusa/train/train.py: `logits[k, :, :-(2 + k)]` against `labels[..., 2 + k:]`),
cross-entropy averaged over answer tokens; the paper's weights lambda_k = 0.8^k for the 1-based
head k (the axolotl Medusa trainer's `medusa_decay_coefficient ** i`, 0.8 in its configs), so
0-based head k weighs 0.8^(k + 1).

EAGLE (SafeAILab/EAGLE eagle/train/main.py): the draft reads (feature of t, token t + 1) and
regresses the feature of t + 1: smooth-L1 (beta 1) averaged over the hidden dimension, plus
0.1 x the cross-entropy of the target's token DISTRIBUTION softmax(lm_head(f_{t+1})) (soft labels,
not the hard token) under log_softmax(lm_head(predicted)); both averaged over loss-mask tokens
(sum / (mask.sum() + 1e-5)). Input features get uniform noise (U[0,1) - 0.5) * 0.2 * 512 / n,
n the sequence's length (`AddUniformNoise`, std 0.2).

LK (Samarin et al. 2026, "LK Losses: Direct Acceptance Rate Optimization for Speculative
Decoding", arXiv 2602.23881; its hyperparameter-free variant): the token term
-log sum_v min(p_v, q_v), minus the log of the probability alpha = 1 - TV(p, q) that speculative
sampling at temperature 1 accepts a token drawn from q. KL is only a proxy for alpha, and a draft
of limited capacity that minimises KL need not maximise alpha; -log alpha's gradient is TV's
scaled by 1 / alpha, so it trains where pure TV's vanishes, and at a one-hot p it is the
cross-entropy.

EAGLE-3 (SafeAILab/EAGLE eagle/traineagle3/cnets.py and main.py): a training-time test of 7
steps; step i scores, at position t, the draft's log-probabilities over its reduced vocabulary
against softmax of the target's logits of position t + 1 + i restricted to that vocabulary
(soft labels), counted where the target's argmax lies in the draft vocabulary and token t + i is
an answer token; steps weigh 0.8^i; no feature regression, no noise.

DFlash (Chen et al. 2026, arXiv 2602.06036; the reference recipe is SpecForge's
specforge/core/dflash.py `OnlineDFlashModel` with scripts/train_dflash.py): per sequence, random
anchors among the answer tokens; each anchor's block [anchor token, mask x (K - 1)] sees the
target's features of the positions before the anchor, and block slot j (1..K-1) is scored on the
token at anchor + j by cross-entropy where that token is an answer token. Slot j weighs
exp(-(j - 1) / gamma) (the paper's Eq. 4; SpecForge's --loss-decay-gamma suggests gamma 7 for
K = 16, 5 for 10 and 4 for 8): an early slot's error ends the accepted prefix, a late one's
rarely matters. The loss is the weighted mean over scored slots.

ReDrafter (apple/ml-recurrent-drafter recurrent_drafting/train/loss.py and model.py): step i
(0-based) of the RNN predicts token t + i + 2 from [h_t; s_{i+1}], cross-entropy on answer
tokens, steps summed with weight 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MEDUSA_DECAY = 0.8
EAGLE_V_W, EAGLE_P_W = 1.0, 0.1
EAGLE_NOISE_STD = 0.2
TOKEN_LOSSES = ("kl", "lk")  # the token term: cross-entropy to p (EAGLE's), or -log alpha


def _masked_mean(x, mask):
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def medusa_loss(logits, tokens, mask, decay: float = MEDUSA_DECAY, positions=None, positions_ok=None):
    """Medusa-1 loss of head logits [B, P, K, V] for tokens [B, T] with answer mask [B, T].

    Head k at position t is scored on tokens[t + k + 2] where that token is an answer token.
    positions int[B, P]: the positions the logits belong to (default all: P = T), of which
    only those with positions_ok count.
    Returns (sum_k decay^(k+1) * CE_k, {"loss_k": [K], "acc_k": [K] top-1 accuracy}).
    """
    k = logits.shape[2]
    return shifted_ce_loss(
        logits, tokens, mask, decay ** jnp.arange(1, k + 1, dtype=jnp.float32), positions, positions_ok
    )


def redrafter_loss(logits, tokens, mask, positions=None, positions_ok=None):
    """ReDrafter loss of step logits [B, P, K, V]: step k at t is scored on tokens[t + k + 2]
    (answer tokens only); the steps' cross-entropies are summed (Apple's drafter_loss)."""
    return shifted_ce_loss(logits, tokens, mask, jnp.ones((logits.shape[2],), jnp.float32), positions, positions_ok)


def sample_positions(key, eligible, n: int):
    """n positions per row drawn uniformly without replacement among `eligible` [B, T] (Gumbel
    top-k). Returns (int32[B, n], ok bool[B, n]: False where a row had fewer than n).

    Medusa and ReDrafter score every position independently, so a step may score a random
    subset of each sequence's positions: the vocabulary projections, their cost on CPU, shrink
    by T / n while the batch still spans whole sequences.
    """
    n = min(n, eligible.shape[1])  # a batch of short sequences: every position
    score = jnp.where(eligible, jax.random.gumbel(key, eligible.shape), -jnp.inf)
    vals, idx = jax.lax.top_k(score, n)
    return idx.astype(jnp.int32), jnp.isfinite(vals)


def labelled(mask, k: int):
    """bool[B, T]: positions t with an answer token among t + 2 .. t + k + 1 (a label for some
    of k heads / steps)."""
    out = jnp.zeros_like(mask)
    for j in range(k):
        out = out | shift_left(mask, j + 2)
    return out


def shifted_ce_loss(logits, tokens, mask, weights, positions=None, positions_ok=None):
    """sum_k weights[k] * CE(logits[:, p, k], tokens[:, positions[p] + k + 2]) averaged over the
    labels that are answer tokens (positions default to all, P = T; positions_ok masks some)."""
    b, p, k, v = logits.shape
    t = tokens.shape[1]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if positions_ok is None:
        positions_ok = jnp.ones(positions.shape, bool)
    losses, accs = [], []
    for j in range(k):
        at = positions + j + 2
        inside = at < t
        at = jnp.minimum(at, t - 1)
        lab = jnp.take_along_axis(tokens, at, axis=1)
        m = inside & positions_ok & jnp.take_along_axis(mask, at, axis=1)
        lg = logits[:, :, j].astype(jnp.float32)
        logp = jax.nn.log_softmax(lg, axis=-1)
        nll = -jnp.take_along_axis(logp, lab[..., None], axis=-1)[..., 0]
        losses.append(_masked_mean(nll, m))
        accs.append(_masked_mean(jnp.argmax(lg, -1) == lab, m))
    losses = jnp.stack(losses)
    return jnp.sum(weights * losses), {"loss_k": losses, "acc_k": jnp.stack(accs)}


def smooth_l1(x, y, beta: float = 1.0):
    """Elementwise smooth-L1 (Huber with delta beta, divided by beta), as torch's SmoothL1Loss."""
    d = jnp.abs(x - y)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def eagle_loss(
    predicted,
    target,
    lm_head,
    mask,
    v_w: float = EAGLE_V_W,
    p_w: float = EAGLE_P_W,
    positions=None,
    ok=None,
    token_loss: str = "kl",
):
    """EAGLE loss of predicted features [B, T, D] against the target's next features [B, T, D].

    lm_head: the target's frozen [V, D] head; mask [B, T]: positions that count.
    positions / ok (int32[B, n], bool[B, n], from `sample_positions`): score the token terms
    (ploss, accuracy) at these positions only; the feature regression always covers every
    position (it is cheap, the vocabulary projections are not).
    token_loss: "kl" (ploss is the cross-entropy to the target's distribution p) or "lk"
    (ploss is -log alpha, alpha = sum_v min(p_v, q_v); module docstring).
    Returns (v_w * vloss + p_w * ploss, {"vloss", "ploss", "kl": KL(p || q), "alpha": mean
    alpha, "acc_k": [1] top-1 agreement of the predicted token with the target's argmax}).
    """
    if token_loss not in TOKEN_LOSSES:
        raise ValueError(f"unknown token loss '{token_loss}' ({' or '.join(TOKEN_LOSSES)})")
    m = mask.astype(jnp.float32)
    denom = jnp.sum(m) + 1e-5
    vloss = jnp.sum(m * jnp.mean(smooth_l1(predicted.astype(jnp.float32), target.astype(jnp.float32)), axis=-1)) / denom
    if positions is not None:
        predicted = jnp.take_along_axis(predicted, positions[..., None], axis=1)
        target = jnp.take_along_axis(target, positions[..., None], axis=1)
        m = (jnp.take_along_axis(mask, positions, axis=1) & ok).astype(jnp.float32)
        denom = jnp.sum(m) + 1e-5
    t_logits = jnp.einsum("btd,vd->btv", target, lm_head, preferred_element_type=jnp.float32)
    target_p = jax.lax.stop_gradient(jax.nn.softmax(t_logits, axis=-1))
    p_logits = jnp.einsum("btd,vd->btv", predicted, lm_head, preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(p_logits, axis=-1)
    ce = -jnp.sum(m * jnp.sum(target_p * logp, axis=-1)) / denom
    # the cross-entropy minus its floor (the target's entropy): the KL the draft still has
    entropy = -jnp.sum(m * jnp.sum(target_p * jax.nn.log_softmax(t_logits, -1), axis=-1)) / denom
    alpha = jnp.sum(jnp.minimum(target_p, jnp.exp(logp)), axis=-1)  # 1 - TV(p, q)  [B, T]
    if token_loss == "lk":
        ploss = -jnp.sum(m * jnp.log(jnp.maximum(alpha, 1e-6))) / denom
    else:
        ploss = ce
    acc = jnp.sum(m * (jnp.argmax(p_logits, -1) == jnp.argmax(t_logits, -1))) / denom
    return v_w * vloss + p_w * ploss, {
        "vloss": vloss,
        "ploss": ploss,
        "kl": ce - entropy,
        "alpha": jnp.sum(m * alpha) / denom,
        "acc_k": acc[None],
    }


def uniform_feature_noise(key, features, lengths, std: float = EAGLE_NOISE_STD):
    """EAGLE's training noise: (U[0,1) - 0.5) * std * 512 / n per sequence of n tokens.

    features [B, T, D]; lengths int[B] (the sequence's tokens, padding excluded).
    """
    scale = std * 512.0 / jnp.maximum(lengths, 1).astype(jnp.float32)
    u = jax.random.uniform(key, features.shape, jnp.float32) - 0.5
    return features + (u * scale[:, None, None]).astype(features.dtype)


def eagle_shift(tokens, final, mask, valid):
    """EAGLE's training pairs at every position t of a batch (last position has no target).

    Returns (input tokens t + 1 [B, T], input features f_t [B, T, D], target features f_{t+1},
    loss mask [B, T]: answer token at t with a token at t + 1, as in SafeAILab's data loader).
    """
    nxt_tok = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    target = jnp.concatenate([final[:, 1:], jnp.zeros_like(final[:, :1])], axis=1)
    nxt_valid = jnp.concatenate([valid[:, 1:], jnp.zeros_like(valid[:, :1])], axis=1)
    return nxt_tok, final, target, mask & valid & nxt_valid


EAGLE3_STEPS = 7
EAGLE3_DECAY = 0.8


def shift_left(x, n: int):
    """x[:, t + n] at position t (zeros past the end), for [B, T, ...] arrays."""
    if n == 0:
        return x
    pad = jnp.zeros_like(x[:, :n])
    return jnp.concatenate([x[:, n:], pad], axis=1)


def eagle3_loss(step_logp, target_logits, target_in_vocab, mask, valid, decay: float = EAGLE3_DECAY):
    """EAGLE-3 training-time-test loss.

    step_logp [K, B, T, N]: the draft's log-probabilities (draft vocabulary of N ids) at step i,
    position t; target_logits [B, T, N]: the target's logits restricted to the draft vocabulary;
    target_in_vocab bool[B, T]: the target's argmax at t lies in the draft vocabulary; mask:
    answer tokens; valid: real tokens. Step i at t is scored against position t + 1 + i where
    the argmax is covered and token t + i is an answer token. Each step's loss is normalised by
    the real positions (SafeAILab takes the mean over all B x T positions of an unpadded batch).
    Returns (sum_i decay^i loss_i, {"loss_k": [K], "acc_k": [K]}).
    """
    k = step_logp.shape[0]
    target_p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    n_pos = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    target_logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    losses, accs, kls = [], [], []
    for i in range(k):
        tp = shift_left(target_p, 1 + i)
        pm = (shift_left(target_in_vocab, 1 + i) & shift_left(mask, i) & shift_left(valid, 1 + i)).astype(jnp.float32)
        logp = step_logp[i].astype(jnp.float32)
        losses.append(-jnp.sum(pm * jnp.sum(tp * logp, axis=-1)) / n_pos)
        ent = -jnp.sum(pm * jnp.sum(tp * shift_left(target_logp, 1 + i), axis=-1)) / n_pos
        kls.append(losses[-1] - ent)
        hit = (jnp.argmax(logp, -1) == jnp.argmax(tp, -1)).astype(jnp.float32)
        accs.append(jnp.sum(hit * pm) / (jnp.sum(shift_left(mask, i) & valid) + 1e-6))
    losses = jnp.stack(losses)
    weights = decay ** jnp.arange(k, dtype=jnp.float32)
    return jnp.sum(weights * losses), {
        "loss_k": losses,
        "acc_k": jnp.stack(accs),
        "kl": jnp.sum(weights * jnp.stack(kls)),
    }


def dflash_decay_gamma(block_size: int) -> float:
    """The paper's gamma for a block of `block_size`: 4, 5, 7 at 8, 10, 16, linear between and
    held outside."""
    return float(np.interp(block_size, [8, 10, 16], [4.0, 5.0, 7.0]))


def dflash_loss(logits, labels, mask, gamma: float):
    """DFlash's block loss of drafted logits [B, N, K - 1, V] (N blocks, the slots after each
    anchor) against labels [B, N, K - 1] where mask [B, N, K - 1] holds.

    Slot j (0-based among the drafted ones) weighs exp(-j / gamma) (`dflash_decay_gamma`).
    Returns (weighted mean cross-entropy, {"loss_k": [K - 1], "acc_k": [K - 1] top-1 accuracy per
    slot, "accepted": mean over blocks of the drafts a greedy chain would accept, its leading
    correct slots, the teacher-forced tokens per step minus one}).
    """
    k = logits.shape[2]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    m = mask.astype(jnp.float32)
    weights = jnp.exp(-jnp.arange(k, dtype=jnp.float32) / gamma) * m
    loss = jnp.sum(weights * nll) / jnp.maximum(jnp.sum(weights), 1e-6)
    hit = (jnp.argmax(logp, -1) == labels) & mask
    per_slot = jnp.maximum(jnp.sum(m, axis=(0, 1)), 1.0)
    blocks = mask[..., 0]
    accepted = jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1)
    return loss, {
        "loss_k": jnp.sum(m * nll, axis=(0, 1)) / per_slot,
        "acc_k": jnp.sum(hit, axis=(0, 1)) / per_slot,
        "accepted": jnp.sum(accepted * blocks) / jnp.maximum(jnp.sum(blocks), 1),
    }
