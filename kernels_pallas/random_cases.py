"""Random inputs of tree-paged attention, and the error measure the kernel is judged by.

Shared by the kernel's tests (tests/test_pallas_kernels.py) and the GPU check
(benchmarks/gpu_check.py), so a GPU run checks exactly the cases the suite checks in interpret mode.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.kernels_pallas.tree_paged_attention_reference import visible_keys_mask


def make_case(seed, *, b=3, t=5, j=None, kvh=2, g=3, d=16, ps=16, n=None, dtype=jnp.float32, window=None, fill=np.nan):
    """Random attention inputs; every pool slot no sequence reads holds `fill` (NaN).

    Tables are shuffled pages padded with the sink page, lengths differ per sequence and are
    not page multiples, tree masks are ancestor masks of random trees (node 0 the root).
    """
    rng = np.random.default_rng(seed)
    j = t if j is None else j
    n = n or -(-(3 * ps + j + ps // 2) // ps)
    cap = n * ps
    num_pages = b * n + 2
    h = kvh * g
    lengths = rng.integers(1, cap - j, size=b)
    lengths[lengths % ps == 0] += 1
    lengths[0] = min(cap - j, ps * 2 + 3)
    lengths = lengths.astype(np.int32)
    perm = rng.permutation(num_pages)
    tables = np.full((b, n), num_pages, np.int32)  # the sink page
    read = np.zeros((num_pages + 1, ps), bool)
    for i in range(b):
        used = -(-(lengths[i] + j) // ps)
        tables[i, :used] = perm[i * n : i * n + used]
        for s in range(lengths[i] + j):
            read[tables[i, s // ps], s % ps] = True
    k = rng.standard_normal((kvh, num_pages + 1, ps, d))
    v = rng.standard_normal((kvh, num_pages + 1, ps, d))
    k[:, ~read] = fill
    v[:, ~read] = fill
    parent = [rng.integers(0, max(1, x)) if x else -1 for x in range(j)]
    anc = np.zeros((j, j), bool)
    for x in range(j):
        anc[x, x] = True
        if parent[x] >= 0:
            anc[x] |= anc[parent[x]]
    # query i of T: a node of the tree over the J scratch keys (the last T when J > T)
    tree = np.stack([anc[j - t :]] * b)
    tree &= rng.random((b, t, 1)) < 0.9  # some queries see no tree key at all
    q = rng.standard_normal((b, t, h, d))
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(tables),
        jnp.asarray(lengths),
        jnp.asarray(tree),
    )
    key_mask = None
    if window is not None:
        vis = visible_keys_mask(args[4], args[5], cap)
        pos = lengths[:, None] + np.arange(t)[None] + (j - t)
        slot = np.arange(cap)
        key_mask = vis & jnp.asarray(pos[:, :, None] - slot[None, None] < window)
    return args, key_mask


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}
