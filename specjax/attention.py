"""Attention over the paged KV cache, the one place its backend is chosen: the Pallas kernel
(`specjax.kernels_pallas.tree_paged_attention`) on GPU, the native CPU kernel (`specjax.cpu.attention`)
on CPU, the XLA reference (`specjax.kernels_pallas.tree_paged_attention_reference`) elsewhere.

The backend is chosen when a function is traced:
- `SPECJAX_ATTENTION` (`specjax.settings`) = `auto` (default) | `pallas` | `pallas-interpret` |
  `cpu` | `xla` sets it for the process; `use_attention_backend(name)` overrides it inside a
  `with` block.
- `auto` runs the Pallas kernel when JAX's default backend is a CUDA GPU of compute capability
  >= 8.0 and the shapes suit it (`unsupported_reason`); on a single CPU device where the native
  kernels build, `specjax.cpu.attention` (float32 heads of a multiple of 64); the reference
  otherwise. A forced `pallas` or `pallas-interpret` raises on shapes the kernel cannot take
  instead of falling back silently; a forced `cpu` raises when the native kernel cannot build.

Functions that jax.jit already traced keep the backend they were traced with, so
`use_attention_backend` clears JAX's compilation caches on entry and exit.

On a device mesh, XLA cannot partition the kernel's custom call: it would gather every KV head
onto every device. Attention traced inside `attention_mesh(mesh)` (specjax.sharding's jitted
functions trace under it) runs the kernel under `shard_map` instead: each device attends with
its own query and KV heads ("model" axis) over its own sequences ("data" axis).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.cpu import attention as cpu_attention
from specjax.cpu.native import register
from specjax.kernels_pallas.tree_paged_attention import tree_paged_attention, unsupported_reason
from specjax.kernels_pallas.tree_paged_attention_reference import (
    attention_with_new_rows,
    tree_paged_attention_reference,
    unwritten_keys_mask,
    visible_keys_mask,
)
from specjax.settings import ATTENTION as _SETTING

ENV_VAR = _SETTING.name
SETTINGS = _SETTING.choices


_MESH = contextvars.ContextVar("attention_mesh", default=None)


@contextlib.contextmanager
def attention_mesh(mesh, batch_axis: str = "data", head_axis: str = "model"):
    """Attention traced inside runs the kernel per device under shard_map over `mesh`: batch
    split over `batch_axis`, heads over `head_axis` (pools [KVH, ...] split over KV heads)."""
    token = _MESH.set((mesh, batch_axis, head_axis) if mesh is not None and mesh.size > 1 else None)
    try:
        yield
    finally:
        _MESH.reset(token)


def _on_mesh(kernel, q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask, k_new, v_new):
    """`kernel` under shard_map over the mesh of `attention_mesh` (or plainly without one, or
    when the heads do not split evenly over its head axis, with a warning)."""
    placed = _MESH.get()
    if placed is None:
        return kernel(q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask, k_new, v_new)
    mesh, batch_axis, head_axis = placed
    tp = mesh.shape[head_axis]
    if k_pages.shape[0] % tp or q.shape[2] % tp:
        warnings.warn(
            f"attention heads ({q.shape[2]} query, {k_pages.shape[0]} KV) do not split "
            f"over {tp} devices: the kernel reads every head on each device",
            stacklevel=3,
        )
        return kernel(q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask, k_new, v_new)
    b = batch_axis if q.shape[0] % mesh.shape[batch_axis] == 0 else None
    pool = P(head_axis, None, None, None)
    rows = P(b, None, head_axis, None)
    specs = (
        rows,
        pool,
        pool,
        P(b, None),
        P(b),
        P(b, None, None),
        None if key_mask is None else P(b, None, None),
        None if k_new is None else rows,
        None if v_new is None else rows,
    )
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False)(
        q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask, k_new, v_new
    )


def attention_setting() -> str:
    """The requested setting: the innermost `use_attention_backend`, else $SPECJAX_ATTENTION."""
    return _SETTING.get()


def use_attention_backend(name: str):
    """Force `name` (one of SETTINGS) inside a `with` block (clears JAX's caches)."""
    return _SETTING.use(name)


def gpu_supports_kernel() -> bool:
    """True when the default backend is CUDA with every device of compute capability >= 8.0."""
    if jax.default_backend() != "gpu":
        return False
    for dev in jax.devices():
        cc = getattr(dev, "compute_capability", None)
        version = str(getattr(getattr(dev, "client", None), "platform_version", "")).lower()
        if dev.platform != "gpu" or cc is None or "rocm" in version:
            return False
        if tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 0):
            return False
    return True


def cpu_supports_kernel() -> bool:
    """True on a single CPU device where specjax's native kernels build (`specjax.cpu.native`)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    return register() is None


def attention_backend() -> str:
    """The backend attention runs on now: "pallas", "pallas-interpret", "cpu" or "xla"."""
    setting = attention_setting()
    if setting == "auto":
        if gpu_supports_kernel():
            return "pallas"
        return "cpu" if cpu_supports_kernel() else "xla"
    return setting


def uses_pallas() -> bool:
    """Whether attention traced now may run the Pallas kernel (which builds its masks itself)."""
    return attention_backend() in ("pallas", "pallas-interpret")


def on_cpu_path() -> bool:
    """Whether code traced now runs on XLA:CPU rather than the GPU's kernel path: the place for
    choices that pay on a CPU only (measured there), which a GPU program should not carry."""
    return jax.default_backend() == "cpu" and not uses_pallas()


def paged_attention(
    q, k_pages, v_pages, block_tables, lengths, tree_mask, *, scale=None, key_mask=None, k_new=None, v_new=None
):
    """Tree-masked attention over the paged cache on the selected backend ([B, T, H, D]).

    Arguments as `tree_paged_attention_reference`. Pass key_mask only when it hides more than
    lengths and tree_mask do (sliding windows), and only as a subset of
    `visible_keys_mask(lengths, tree_mask)`: the kernel then reads it tile by tile; without it
    the kernel builds the mask itself and reads no mask bytes.
    k_new, v_new [B, T, KVH, D]: the tree keys of slots lengths + i, not yet written (a verify
    pass deferring its writes); the pools' tree slots are then never read.
    """
    if not q.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(
            f"attention queries are {q.dtype} but the KV pools {k_pages.dtype}/"
            f"{v_pages.dtype}: the pools must take the model's dtype"
        )
    backend = attention_backend()
    if k_new is not None and backend not in ("pallas", "pallas-interpret"):
        return _with_new_rows(q, k_pages, v_pages, block_tables, lengths, tree_mask, scale, key_mask, k_new, v_new)
    if backend == "cpu":
        if cpu_attention.kernel_applies(q, k_pages):
            if key_mask is None:
                key_mask = visible_keys_mask(lengths, tree_mask, block_tables.shape[1] * k_pages.shape[2])
            return cpu_attention.cpu_paged_attention(q, k_pages, v_pages, block_tables, key_mask, scale=scale)
    elif backend != "xla":
        if backend == "pallas" and jax.default_backend() == "gpu" and not gpu_supports_kernel():
            raise ValueError(
                "attention backend 'pallas' forced, but the GPU's compute capability "
                "is below 8.0 (the kernel needs Ampere or newer)"
            )
        reason = unsupported_reason(q, k_pages, tree_mask)
        if reason is None:
            kernel = functools.partial(_kernel, scale=scale, interpret=backend == "pallas-interpret")
            return _on_mesh(kernel, q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask, k_new, v_new)
        if attention_setting() != "auto":
            raise ValueError(f"attention backend {backend!r} forced, but the kernel cannot run: {reason}")
        warnings.warn(f"the Pallas attention kernel cannot run ({reason}): using the XLA reference", stacklevel=2)
        if k_new is not None:
            return _with_new_rows(q, k_pages, v_pages, block_tables, lengths, tree_mask, scale, key_mask, k_new, v_new)
    return tree_paged_attention_reference(
        q, k_pages, v_pages, block_tables, lengths, tree_mask, scale=scale, key_mask=key_mask
    )


def _kernel(q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask, k_new, v_new, *, scale, interpret):
    return tree_paged_attention(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        tree_mask,
        scale=scale,
        key_mask=key_mask,
        k_new=k_new,
        v_new=v_new,
        interpret=interpret,
    )


def _with_new_rows(q, k_pages, v_pages, block_tables, lengths, tree_mask, scale, key_mask, k_new, v_new):
    """The reference with the unwritten tree rows (slots lengths + i) appended."""
    t = q.shape[1]
    num_slots = block_tables.shape[1] * k_pages.shape[2]
    seen = visible_keys_mask(lengths, tree_mask, num_slots) if key_mask is None else key_mask
    slots = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None, :]
    mask = unwritten_keys_mask(seen, slots, jnp.ones(slots.shape, bool))
    return attention_with_new_rows(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale=scale)


def attention_unwritten(q, k, v, k_pages, v_pages, block_tables, mask):
    """Attention as if k, v [B, T, KVH, D] were written, without writing the pools; mask from
    `unwritten_keys_mask`.

    XLA cannot update buffers in place across the branches of a `lax.switch` (it copies every
    pool in and out of the branch each step); a verify pass inside one defers its writes instead.
    On the CPU attention backend the kernel reads the new rows where they are.
    """
    if attention_backend() == "cpu" and cpu_attention.kernel_applies(q, k_pages):
        return cpu_attention.cpu_paged_attention(q, k_pages, v_pages, block_tables, mask, k, v)
    return attention_with_new_rows(q, k_pages, v_pages, block_tables, mask, k, v)
