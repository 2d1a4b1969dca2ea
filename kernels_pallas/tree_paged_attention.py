"""Pallas GPU kernel of tree-masked attention over the paged KV cache.

Same signature and results as `tree_paged_attention_reference` beside it: query i of sequence b
sees the committed keys (slots < lengths[b]) and the tree keys j with tree_mask[b, i, j], which
sit in slots lengths[b] + j. One kernel serves decode (T = 1), chain and tree verification
(T <= 64), EAGLE drafting over scratch slots (tree_mask [B, T, J], J != T) and prefill chunks
(T up to the chunk, causal tree_mask).

Backend: Pallas' Triton lowering (`jax.experimental.pallas.triton`). It lowers for every NVIDIA
GPU of compute capability 8.0 and newer (A100, L4/L40, H100, ...), the range TensorRT-LLM
targets; Mosaic GPU is Hopper/Blackwell-only. Triton's pointer loads also give what paged
attention needs and Mosaic's TMA does not: per-row gathers through the block table, and masked
loads that never touch memory for hidden slots (unused pages may hold NaN, and sliding windows
skip their bytes).

Layout of the work: a program owns one sequence b, one KV head and `block_q` query rows, where
row r = t * G + g is tree node t under query head kv_head * G + g (GQA: the G query heads of a
KV head share every K/V load). It streams the committed slots in blocks of `block_k` slots
(online softmax, float32 accumulators), then the tree slots in blocks of `block_j`. When the
batch and heads give too few programs to fill the GPU (decode at small batch), the committed
slots are split over `k_splits` programs and their partial results are merged by XLA
(flash-decoding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unsupported_reason(q, k_pages, tree_mask) -> str | None:
    """Why the kernel cannot take these shapes/dtypes (None when it can).

    Triton tensors must have power-of-two sizes and its matrix products need every dimension
    >= 16, so the head dim and the page size must be powers of two and head_dim >= 16.
    """
    d = q.shape[-1]
    if not _is_pow2(d) or d < 16:
        return f"head_dim {d} is not a power of two >= 16"
    if not _is_pow2(k_pages.shape[2]):
        return f"page_size {k_pages.shape[2]} is not a power of two"
    for x in (q, k_pages):
        if not any(x.dtype == dt for dt in SUPPORTED_DTYPES):
            return f"dtype {x.dtype} is not float32/bfloat16/float16"
    if tree_mask.ndim != 3 or tree_mask.shape[:2] != q.shape[:2]:
        return f"tree_mask {tree_mask.shape} does not match q {q.shape}"
    return None


# Shared memory per SM (KiB) by compute capability, which Triton stages the K/V tiles through:
# A100/H100-class parts have 163-227 KiB, A10/L4/RTX 30xx-40xx 99 KiB.
SHARED_MEMORY_KIB = {(8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99, (9, 0): 227, (10, 0): 227, (12, 0): 99}
HOPPER_KIB = 227  # off a GPU (interpret mode, CUDA lowering on CPU): the H100's tiles


def shared_memory_kib() -> int:
    """Shared memory per SM of the default device (the smallest known for an unknown GPU)."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or cc is None:
        return HOPPER_KIB
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    return SHARED_MEMORY_KIB.get((major, minor), min(SHARED_MEMORY_KIB.values()))


def default_blocks(
    b: int,
    t: int,
    h: int,
    kvh: int,
    page_size: int,
    num_slots: int,
    *,
    d: int = 128,
    itemsize: int = 2,
    num_stages: int = 2,
    smem_kib: int | None = None,
):
    """(block_q, block_k, k_splits, num_warps): tile sizes and split count from static shapes.

    Decode has few query rows per KV head: wide key blocks keep more bytes in flight. Enough
    programs (~256, two per SM of an H100) keep every SM streaming; each split still reads at
    least 256 slots, and the float32 partials a split writes and the merge reads stay within a
    quarter of the K/V bytes (rows * 8 bytes per split vs slots * 4 per head dim). The q tile
    and `num_stages` K/V tiles must fit three quarters of the SM's shared memory (`smem_kib`,
    default the device's): key blocks shrink first, then query blocks (sm86/sm89: 99 KiB).
    """
    rows = t * (h // kvh)
    block_q = min(128, max(16, _pow2(rows)))
    block_k = max(page_size, 128 if block_q <= 32 else 64)
    budget = 0.75 * 1024 * (shared_memory_kib() if smem_kib is None else smem_kib)
    tiles = lambda bq, bk: (bq + 2 * bk * num_stages) * d * itemsize
    while tiles(block_q, block_k) > budget and block_k > 16:
        block_k //= 2
    while tiles(block_q, block_k) > budget and block_q > 16:
        block_q //= 2
    q_blocks = -(-rows // block_q)
    programs = b * kvh * q_blocks
    k_splits = max(1, min(-(-256 // programs), num_slots // 256, num_slots // (8 * q_blocks * block_q)))
    num_warps = 8 if block_q >= 128 else 4
    return block_q, block_k, k_splits, num_warps


def _tree_block_ranges(tree_mask, g: int, block_q: int, q_blocks: int, block_j: int):
    """int32[B, q_blocks] first and one-past-last tree key block that some row of the block sees.

    A causal prefill chunk then reads about half of its own keys, and no query block computes
    over tree blocks it cannot see.
    """
    b, t, j = tree_mask.shape
    cols = jnp.arange(j, dtype=jnp.int32)
    first = jnp.min(jnp.where(tree_mask, cols, j), axis=-1)  # [B, T]; j when none
    last = jnp.max(jnp.where(tree_mask, cols, -1), axis=-1)  # -1 when none
    rows = jnp.arange(q_blocks * block_q)
    node = jnp.minimum(rows // g, t - 1)
    real = (rows < t * g)[None]
    first = jnp.where(real, first[:, node], j).reshape(b, q_blocks, block_q).min(-1)
    last = jnp.where(real, last[:, node], -1).reshape(b, q_blocks, block_q).max(-1)
    lo = first // block_j
    hi = jnp.where(last >= 0, last // block_j + 1, 0)
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def _kernel(
    lengths_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    tree_ref,
    *rest,
    t,
    g,
    num_slots,
    page_size,
    block_q,
    block_k,
    block_j,
    k_splits,
    scale,
    has_key_mask,
    has_ranges,
    split_out,
    has_new,
):
    rest = list(rest)
    k_new_ref, v_new_ref = (rest.pop(0), rest.pop(0)) if has_new else (None, None)
    key_ref = rest.pop(0) if has_key_mask else None
    lo_ref, hi_ref = (rest.pop(0), rest.pop(0)) if has_ranges else (None, None)
    out_refs = rest
    b, kv_head, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qb, split = i // k_splits, i % k_splits
    num_table = tables_ref.shape[0]
    num_pages = k_ref.shape[0]  # pool pages, the sink included
    j_total = tree_ref.shape[1]
    d = q_ref.shape[-1]
    cdtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
    # Triton's default for float32 products is TF32 (10-bit mantissa): ask for IEEE float32.
    precision = lax.Precision.HIGHEST if cdtype == jnp.float32 else None

    rows = qb * block_q + jnp.arange(block_q)
    row_ok = rows < t * g
    node = jnp.minimum(rows // g, t - 1)
    head = kv_head * g + rows % g
    # Gathers index every axis with an array (interpret mode takes no mix of arrays and slices).
    dim = jnp.arange(d)[None, :]
    q = plgpu.load(q_ref.at[node[:, None], head[:, None], dim], mask=row_ok[:, None], other=0).astype(cdtype)
    length = lengths_ref[b]
    committed = jnp.minimum(length, num_slots)

    def pool_rows(slot):
        """A loader of the pool rows at cache slots `slot` [K] (through the block table)."""
        index = jnp.clip(slot // page_size, 0, num_table - 1)
        page = jnp.clip(plgpu.load(tables_ref.at[index]), 0, num_pages - 1)[:, None]
        offset = (slot % page_size)[:, None]
        return lambda ref, used: plgpu.load(ref.at[page, offset, dim], mask=used[:, None], other=0)

    def new_rows(col):
        """A loader of the unwritten rows k_new/v_new at tree columns `col` [K]."""
        row = jnp.clip(col, 0, j_total - 1)[:, None]
        return lambda ref, used: plgpu.load(ref.at[row, dim], mask=used[:, None], other=0)

    def attend(rows, refs, vis, carry):
        """Online-softmax update with the keys `rows` loads from refs (K, V) under visibility
        vis [block_q, K]."""
        o, m, l = carry
        # Slots no row sees are never loaded (other=0): NaN in unused pages cannot leak.
        used = jnp.max(vis.astype(jnp.int32), axis=0) > 0
        k = rows(refs[0], used).astype(cdtype)
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
        corr = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        v = rows(refs[1], used)
        o = o * corr[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return o, m_new, l * corr + jnp.sum(p, axis=1)

    def key_mask_tile(slot, ok):
        tile = plgpu.load(
            key_ref.at[node[:, None], jnp.clip(slot, 0, num_slots - 1)[None, :]],
            mask=row_ok[:, None] & ok[None, :],
            other=False,
        )
        return tile

    def committed_block(blk, carry):
        slot = blk * block_k + jnp.arange(block_k)
        ok = slot < committed
        vis = key_mask_tile(slot, ok) if has_key_mask else jnp.broadcast_to(ok[None, :], (block_q, block_k))
        return attend(pool_rows(slot), (k_ref, v_ref), vis & row_ok[:, None], carry)

    def tree_block(blk, carry):
        col = blk * block_j + jnp.arange(block_j)
        slot = length + col
        ok = (col < j_total) & (slot < num_slots)
        vis = plgpu.load(
            tree_ref.at[node[:, None], jnp.clip(col, 0, j_total - 1)[None, :]],
            mask=row_ok[:, None] & ok[None, :],
            other=False,
        )
        if has_key_mask:
            vis = vis & key_mask_tile(slot, ok)
        if has_new:
            return attend(new_rows(col), (k_new_ref, v_new_ref), vis, carry)
        return attend(pool_rows(slot), (k_ref, v_ref), vis, carry)

    carry = (
        jnp.zeros((block_q, d), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    blocks = pl.cdiv(committed, block_k)
    per_split = pl.cdiv(blocks, k_splits)
    first = split * per_split
    carry = lax.fori_loop(first, jnp.minimum(first + per_split, blocks), committed_block, carry)
    if has_ranges:
        t_lo, t_hi = lo_ref[b, qb], hi_ref[b, qb]
    else:
        t_lo, t_hi = jnp.int32(0), jnp.int32(pl.cdiv(j_total, block_j))
    # The first split also reads the tree keys. (Bounds stay int32 arrays: a select of two
    # Python ints lowers to i1 and Triton's scf.for then fails to verify.)
    t_hi = jnp.where(split == 0, t_hi, t_lo).astype(jnp.int32)
    o, m, l = lax.fori_loop(t_lo, t_hi, tree_block, carry)

    if split_out:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
    else:  # whole blocks of rows: padding rows land in padding, never on a real row
        (out_ref,) = out_refs
        out = o / jnp.where(l == 0, 1.0, l)[:, None]  # a row that sees no key gets zeros
        out_ref[...] = out.astype(out_ref.dtype)


def tree_paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    tree_mask,
    *,
    scale=None,
    key_mask=None,
    k_new=None,
    v_new=None,
    interpret=False,
    block_q=None,
    block_k=None,
    block_j=64,
    k_splits=None,
    num_warps=None,
    num_stages=2,
):
    """Attention of q [B, T, H, D] over the paged cache; returns [B, T, H, D] in q's dtype.

    k_pages, v_pages: [KVH, P + 1, page_size, D]; block_tables int32[B, n]; lengths int32[B];
    tree_mask bool[B, T, J] over the slots lengths .. lengths + J - 1. key_mask (bool[B, T,
    n * page_size], optional) hides further keys (sliding windows): the kernel reads only the
    committed and tree slots, so it equals the reference's `key_mask` whenever that mask is a
    subset of `visible_keys_mask(lengths, tree_mask)`, as the model's always is.
    k_new, v_new ([B, J, KVH, D], optional): the tree keys themselves, not yet written to their
    slots lengths .. lengths + J - 1 (a verify pass that defers its writes until after its
    `lax.switch`, where XLA would copy every pool written inside a branch); the pools' tree slots
    are then never read. The tile sizes default to `default_blocks`; interpret=True runs the
    same kernel body on CPU.
    """
    reason = unsupported_reason(q, k_pages, tree_mask)
    if reason:
        raise ValueError(f"tree_paged_attention kernel: {reason}")
    b, t, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
    g = h // kvh
    n = block_tables.shape[1]
    num_slots = n * page_size
    j_total = tree_mask.shape[-1]
    auto = default_blocks(b, t, h, kvh, page_size, num_slots, d=d, itemsize=q.dtype.itemsize, num_stages=num_stages)
    block_q = block_q or auto[0]
    block_k = block_k or auto[1]
    k_splits = k_splits or auto[2]
    num_warps = num_warps or auto[3]
    block_j = max(16, min(block_j, _pow2(j_total)))
    for name, size in (("block_q", block_q), ("block_k", block_k), ("block_j", block_j)):
        if not _is_pow2(size) or size < 16:
            raise ValueError(f"{name}={size} must be a power of two >= 16")
    scale = float(d**-0.5 if scale is None else scale)
    q_blocks = -(-t * g // block_q)
    has_ranges = j_total > block_j
    split_out = k_splits > 1

    inputs = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32), q, k_pages, v_pages, tree_mask.astype(bool)]
    specs = [
        pl.BlockSpec((b,), lambda bi, hi, i: (0,)),
        pl.BlockSpec((None, n), lambda bi, hi, i: (bi, 0)),
        pl.BlockSpec((None, t, h, d), lambda bi, hi, i: (bi, 0, 0, 0)),
        pl.BlockSpec((None,) + k_pages.shape[1:], lambda bi, hi, i: (hi, 0, 0, 0)),
        pl.BlockSpec((None,) + v_pages.shape[1:], lambda bi, hi, i: (hi, 0, 0, 0)),
        pl.BlockSpec((None, t, j_total), lambda bi, hi, i: (bi, 0, 0)),
    ]
    has_new = k_new is not None
    if has_new:
        if k_new.shape != (b, j_total, kvh, d) or v_new is None or v_new.shape != k_new.shape:
            raise ValueError(f"k_new/v_new must be [B, J, KVH, D] = {(b, j_total, kvh, d)}")
        inputs += [k_new.astype(k_pages.dtype), v_new.astype(v_pages.dtype)]
        specs += [pl.BlockSpec((None, j_total, None, d), lambda bi, hi, i: (bi, 0, hi, 0))] * 2
    if key_mask is not None:
        inputs.append(key_mask.astype(bool))
        specs.append(pl.BlockSpec((None, t, num_slots), lambda bi, hi, i: (bi, 0, 0)))
    if has_ranges:
        for r in _tree_block_ranges(tree_mask, g, block_q, q_blocks, block_j):
            inputs.append(r)
            specs.append(pl.BlockSpec((b, q_blocks), lambda bi, hi, i: (0, 0)))
    if split_out:
        rows = q_blocks * block_q
        out_shape = [
            jax.ShapeDtypeStruct((b, kvh, k_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, k_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, k_splits, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, block_q, d), lambda bi, hi, i: (bi, hi, i % k_splits, i // k_splits, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, hi, i: (bi, hi, i % k_splits, i // k_splits)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, hi, i: (bi, hi, i % k_splits, i // k_splits)),
        ]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, kvh, q_blocks * block_q, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i: (bi, hi, i, 0))]

    kernel = functools.partial(
        _kernel,
        t=t,
        g=g,
        num_slots=num_slots,
        page_size=page_size,
        block_q=block_q,
        block_k=block_k,
        block_j=block_j,
        k_splits=k_splits,
        scale=scale,
        has_key_mask=key_mask is not None,
        has_ranges=has_ranges,
        split_out=split_out,
        has_new=has_new,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, kvh, q_blocks * k_splits),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"tree_paged_attention_q{block_q}_k{block_k}_s{k_splits}",
    )(*inputs)
    out = _merge_splits(*outs) if split_out else outs[0]
    out = out[:, :, : t * g].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _merge_splits(o, m, l):
    """[B, KVH, R, D] float32 from per-split partials o [B, KVH, S, R, D], m and l [B, KVH, S, R]."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)  # 0 for splits that saw nothing
    denom = jnp.sum(w * l, axis=2)
    return jnp.sum(w[..., None] * o, axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]
