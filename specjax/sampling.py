"""Token sampling: temperature, top-k and top-p applied to logits the way vanilla decoding does.

Speculative acceptance later applies the same `processed_logprobs` to the target (and draft)
distributions, so lossless methods sample from exactly what vanilla sampling samples from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import on_cpu_path


class SamplingError(ValueError):
    """Invalid sampling settings."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings, one for every row (scalars) or one per row (arrays [B]); temperature 0
    means greedy. A pytree: the settings are traced values, so a new temperature, top-k or top-p
    runs the compiled program of the old one. `greedy` (static: it picks the program) is whether
    every row is greedy; rows of temperature 0 in a program that samples draw their argmax.
    `SamplingConfig.rows([...])` stacks per-request settings for one batch."""

    temperature: float | jax.Array = 0.0
    top_k: int | jax.Array = 0  # 0: off
    top_p: float | jax.Array = 1.0
    greedy: bool | None = None  # None: read off the temperatures (which must then be concrete)

    def __post_init__(self):
        values = [self.temperature, self.top_k, self.top_p]
        if any(isinstance(v, jax.core.Tracer) for v in values):
            if self.greedy is None:
                raise SamplingError("traced sampling settings need `greedy` given")
            return
        t, k, p = (np.asarray(v) for v in values)
        if not np.all(t >= 0.0) or not np.all(np.isfinite(t)):
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not np.all((p > 0.0) & (p <= 1.0)):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not np.all(k >= 0) or not np.all(k == np.floor(k)):
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k}")
        # One type per setting, so that calls differing only in values share a program.
        for name, value, kind in (("temperature", t, float), ("top_k", k, int), ("top_p", p, float)):
            typed = kind(value) if value.ndim == 0 else value.astype(np.float32 if kind is float else np.int32)
            object.__setattr__(self, name, typed)
        if self.greedy is None:
            object.__setattr__(self, "greedy", bool(np.all(t == 0.0)))
        elif self.greedy and not np.all(t == 0.0):
            raise SamplingError("greedy=True with a temperature above 0")

    @classmethod
    def rows(cls, settings) -> SamplingConfig:
        """One batch's settings from each row's own (a sequence of SamplingConfigs of scalars)."""
        settings = list(settings)
        if not settings:
            raise SamplingError("no rows")
        return cls(
            np.asarray([s.temperature for s in settings], np.float32),
            np.asarray([s.top_k for s in settings], np.int32),
            np.asarray([s.top_p for s in settings], np.float32),
            all(s.greedy for s in settings),
        )

    def settings(self) -> dict:
        """temperature, top_k and top_p, as plain numbers or lists (for JSON records)."""
        return {k: np.asarray(getattr(self, k)).tolist() for k in ("temperature", "top_k", "top_p")}

    def __eq__(self, other):
        if not isinstance(other, SamplingConfig):
            return NotImplemented
        leaves = lambda c: [np.asarray(v).tolist() for v in (c.temperature, c.top_k, c.top_p)]
        return self.greedy == other.greedy and leaves(self) == leaves(other)

    def __hash__(self):
        return hash((self.greedy, *(str(np.asarray(v).tolist()) for v in (self.temperature, self.top_k, self.top_p))))


def _unflatten_sampling(greedy, leaves):
    config = object.__new__(SamplingConfig)  # no checks: the leaves may be tracers
    for name, value in zip(("temperature", "top_k", "top_p"), leaves):
        object.__setattr__(config, name, value)
    object.__setattr__(config, "greedy", greedy)
    return config


jax.tree_util.register_pytree_node(
    SamplingConfig, lambda c: ((c.temperature, c.top_k, c.top_p), c.greedy), _unflatten_sampling
)


def per_row(value, like):
    """A setting (a scalar, or one value per row [B]) shaped to broadcast against `like`
    [B, ..., V]: [B, 1, ..., 1]."""
    value = jnp.asarray(value)
    if value.ndim == 0:
        return value
    return value.reshape(value.shape + (1,) * (like.ndim - 1))


def _order_key(x):
    """int32 keys that order as the float32 values do, a NaN above everything."""
    k = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    k = jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k)
    return jnp.where(jnp.isnan(x), jnp.iinfo(jnp.int32).max, k)


def _first_max_exact(x):
    """argmax_last over integer keys: a max then the smallest index holding it."""
    k = _order_key(x)
    m = jnp.max(k, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, k.shape, k.ndim - 1)
    return jnp.min(jnp.where(k == m, index, k.shape[-1]), axis=-1)


def _first_max_blockwise(x, block: int):
    """argmax_last of NaN-free x: the first block holding the largest value, then the first
    match inside it."""
    v = x.shape[-1]
    n = -(-v // block)
    if n * block != v:  # -inf padding comes after every real value, so it never wins a tie
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * block - v)], constant_values=-jnp.inf)
    blocks = x.reshape(x.shape[:-1] + (n, block))
    first = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(blocks, first[..., None, None], axis=-2)[..., 0, :]
    return first * block + jnp.argmax(inside, axis=-1).astype(jnp.int32)


def argmax_last(x, block: int = 1024):
    """int32 index of the largest value along the last axis, the first on ties (a NaN counts as
    largest): what jnp.argmax gives.

    XLA:CPU runs jnp.argmax's (value, index) reduction without vectorizing it, and it runs for
    every greedy token, every tree node, every categorical draw. A vectorized max per block of
    `block` values and jnp.argmax over the few block maxima and inside the one winning block
    cost a fraction of that, a sum included that sends inputs holding a NaN (which XLA:CPU's
    vectorized max need not propagate) to an exact search over integer keys. Elsewhere (GPU) plain jnp.argmax.
    """
    if not on_cpu_path():
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if x.shape[-1] < 4 * block:
        return _first_max_exact(x)
    return jax.lax.cond(jnp.isnan(jnp.sum(x)), _first_max_exact, lambda y: _first_max_blockwise(y, block), x)


def categorical(key, logits):
    """One draw from softmax(logits) over the last axis (one key for all of logits' rows; a row
    without a finite logit gives 0). On a GPU it is jax.random.categorical's draw (the argmax of
    logits plus Gumbel noise); on XLA:CPU `inverse_cdf_draw`'s, from the same law, since the
    Gumbel noise is what costs there."""
    if on_cpu_path():
        return inverse_cdf_draw(key, logits)
    return gumbel_max_draw(key, logits)


def gumbel_max_draw(key, logits):
    """jax.random.categorical(key, logits)'s draw: argmax of logits plus Gumbel noise."""
    return argmax_last(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def _cumulative_pick(w, u):
    """int32 index along the last axis of w >= 0 where u * sum(w) falls in w's cumulative sum: i
    with probability w[i] / sum(w) for u uniform in [0, 1). Never an entry without mass (when
    rounding puts u * sum(w) at the end, the last entry with mass; 0 when none has mass)."""
    c = jnp.cumsum(w, axis=-1)
    i = jnp.sum(c <= u[..., None] * c[..., -1:], axis=-1)
    has = w > 0
    last = w.shape[-1] - 1 - jnp.argmax(jnp.flip(has, axis=-1), axis=-1)
    return jnp.minimum(i, jnp.where(jnp.any(has, axis=-1), last, 0)).astype(jnp.int32)


def inverse_cdf_draw(key, logits, block: int = 256):
    """One draw from softmax(logits) over the last axis by inverting its cumulative sum, in two
    levels: a block of `block` tokens by the blocks' masses, then a token inside it, each from
    its own uniform (a multiple of 2**-23: each level resolves its probabilities to that share
    of its mass, to within float32 rounding of sums over a few hundred values).

    Two uniforms replace the V Gumbel samples of gumbel_max_draw: on XLA:CPU (AMD EPYC, 2 cores)
    0.19 ms instead of 0.82 ms for one 49152-logit row, a draw every sampled token pays.
    """
    v = logits.shape[-1]
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    w = jnp.exp(x - jnp.where(jnp.isfinite(top), top, 0.0))
    if v <= block:  # one level: padding a small vocabulary to a block would multiply the work
        return _cumulative_pick(w, jax.random.uniform(key, x.shape[:-1]))
    n = -(-v // block)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, n * block - v)]).reshape(w.shape[:-1] + (n, block))
    u = jax.random.uniform(key, (2,) + x.shape[:-1])
    b = _cumulative_pick(jnp.sum(w, axis=-1), u[0])
    inside = jnp.take_along_axis(w, b[..., None, None], axis=-2)[..., 0, :]
    return b * block + _cumulative_pick(inside, u[1])


def gumbel_top_k(keys, logq, k: int):
    """k distinct tokens drawn without replacement from softmax(logq) along the last axis, in
    draw order, and their perturbed values (logq + Gumbel noise; -inf: not a real draw, when
    fewer than k tokens have probability). keys: one PRNG key, or one per index of logq's
    leading axes (a batch [B] of keys for logq [B, ...]), each drawing its rows' noise.

    The Gumbel-top-k trick: the order of logq plus Gumbel noise, largest first, is a sequence of
    draws without replacement, so its first k are the first k draws (the first is
    `gumbel_max_draw`'s with the same key). The values drive stochastic beam search (EAGLE's
    trees for the `recursive` rule). The top k of all rows run in one call of the CPU kernel
    where it runs (XLA:CPU's top_k sorts the whole row).
    """
    from specjax.cpu.top_k import top_log_probs

    typed = jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    batch = keys.ndim - (0 if typed else 1)
    noise = lambda key: jax.random.gumbel(key, logq.shape[batch:], logq.dtype)
    for _ in range(batch):
        noise = jax.vmap(noise)
    perturbed = noise(keys) + logq
    tokens = jnp.clip(top_log_probs(perturbed, k)[1], 0, logq.shape[-1] - 1)
    return tokens, jnp.take_along_axis(perturbed, tokens, -1)


def kth_largest(x, k: int):
    """The k-th largest value along the last axis, shaped [..., 1].

    The barrier keeps XLA:CPU from fusing top_k into a consumer that compares against it, a
    fusion that turns the top_k into a full sort of the row.
    """
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k)[0])[..., -1:]


def _order_keys(x):
    """int32 keys ordered like the float32 values, -0 equal to +0."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def top_p_mask(logits, top_p):
    """bool [..., V]: the tokens top-p keeps, by HF's rule, without sorting the vocabulary.

    A value v is kept when the probability of the tokens strictly more likely than v is below
    top_p (so ties are kept together and the most likely token always is); top_p may be one
    value per row, shaped to broadcast against logits' leading axes. That mass falls as v
    rises, so the smallest kept value is found by bisection over the floats' ordered integer
    keys: 32 passes over the row, far cheaper than XLA:CPU's sort of a whole vocabulary.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _order_keys(logits)
    lo = jnp.full(logits.shape[:-1] + (1,), jnp.iinfo(jnp.int32).min, jnp.int32)  # mass >= p
    hi = jnp.max(keys, axis=-1, keepdims=True)  # nothing above the maximum: mass 0 < p

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        below = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return keys >= hi


def top_k_mask(logits, k):
    """bool [..., V]: the tokens at or above the k-th largest value (ties kept together), for k
    per row (broadcast against logits' leading axes; k <= 0 or >= V: every token). A bisection
    over the floats' ordered integer keys, as in top_p_mask, so k need not be static."""
    keys = _order_keys(logits)
    k = jnp.asarray(k, jnp.int32)
    lo = jnp.full(logits.shape[:-1] + (1,), jnp.iinfo(jnp.int32).min, jnp.int32)  # count >= k
    hi = jnp.max(keys, axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2) without overflow
        enough = jnp.sum(keys >= mid, axis=-1, keepdims=True) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return (keys >= lo) | (k <= 0) | (k >= logits.shape[-1])


def _when(setting, test, f, x):
    """f(x) where test(setting) holds for some row, else x: decided while tracing when the
    setting is known then (given as Python or NumPy numbers), by a conditional when traced."""
    if not isinstance(setting, jax.core.Tracer):
        return f(x) if np.any(test(np.asarray(setting))) else x
    return jax.lax.cond(jnp.any(test(setting)), f, lambda x: x, x)


TOP_K_FAST = 64  # top-k up to this takes the k-th value from one top-k pass; above, a bisection


def top_k_keep(logits, k, small: bool | None = None):
    """bool [..., V]: the tokens top-k keeps, k per row (shaped to broadcast against logits;
    <= 0 or >= V: all). When every row's k is at most TOP_K_FAST the k-th largest value comes
    from one top-k pass (the native kernel on a CPU); otherwise `top_k_mask`'s bisection.
    small: whether that holds, when known while tracing (None: decided on the device)."""
    v = logits.shape[-1]
    every = (k <= 0) | (k >= v)

    def fast(x):
        from specjax.cpu.top_k import top_log_probs

        _, ids = top_log_probs(x, min(TOP_K_FAST, v))
        at = jnp.broadcast_to(jnp.clip(k - 1, 0, ids.shape[-1] - 1), x.shape[:-1] + (1,))
        kth = jnp.take_along_axis(x, jnp.take_along_axis(ids, at, axis=-1), axis=-1)
        return (x >= kth) | every

    if small is not None:
        return fast(logits) if small else top_k_mask(logits, k)
    return jax.lax.cond(jnp.all(every | (k <= TOP_K_FAST)), fast, lambda x: top_k_mask(x, k), logits)


def processed_logprobs(logits, sampling: SamplingConfig):
    """float32 log-probabilities [..., V] after temperature, top-k and top-p (masked to -inf),
    each row [B, ...] by its own settings; a row of temperature 0 gets all its mass on its argmax
    (the first on ties), so that drawing from it is greedy decoding. Each part runs only when
    some row needs it."""
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    t, k, p = (per_row(s, x) for s in (sampling.temperature, sampling.top_k, sampling.top_p))
    x = x / jnp.where(t == 0.0, 1.0, t)
    small = (
        None if isinstance(sampling.top_k, jax.core.Tracer) else bool(np.all(np.asarray(sampling.top_k) <= TOP_K_FAST))
    )
    x = _when(sampling.top_k, lambda k: (k > 0) & (k < v), lambda x: jnp.where(top_k_keep(x, k, small), x, -jnp.inf), x)
    x = _when(sampling.top_p, lambda p: p < 1.0, lambda x: jnp.where(top_p_mask(x, p) | (p >= 1.0), x, -jnp.inf), x)

    def argmax_rows(logp):
        iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        return jnp.where(t == 0.0, jnp.where(argmax_last(logits)[..., None] == iota, 0.0, -jnp.inf), logp)

    return _when(sampling.temperature, lambda t: t == 0.0, argmax_rows, jax.nn.log_softmax(x, axis=-1))


def sample_tokens(logits, keys, sampling: SamplingConfig):
    """One token per row of logits [B, V]; keys: one PRNG key per row."""
    if sampling.greedy:
        return argmax_last(logits)
    return jax.vmap(categorical)(keys, processed_logprobs(logits, sampling))
