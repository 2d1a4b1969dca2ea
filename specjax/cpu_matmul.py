"""Few-row matrix products on CPU through a native kernel (`cpu_kernels/rows_matmul.cc`).

A decode, verify or draft pass multiplies a handful of rows by every weight, so it is bound by
streaming the weights from memory; XLA:CPU's GEMM packs the weight and turns compute-bound from a
few rows on, which made a 4-token verify cost ~1.4x a decode step and capped every method's
speedup (README, "What one verify pass costs"). The kernel reads each weight once for all rows,
prefetching ahead, and computes each output the same way whatever the row count: a row's
product is bit-identical in a one-token decode and in a T-token verify.

The kernel is built with the machine's g++ on first use (`specjax.cpu_native`) and called as an
XLA FFI custom call. Chosen when a function is traced:
- `SPECJAX_CPU_MATMUL` = `auto` (default) | `kernel` | `xla`; `use_cpu_matmul(name)` overrides
  it inside a `with` block.
- `auto` uses the kernel for float32 rows times float32 or float16 weights (widened exactly in
  registers: a float16 weight streams half the bytes), at most `MAX_ROWS` rows, when the process
  has a single device (a custom call cannot be split over a mesh by XLA's partitioner) on an
  x86-64 CPU with AVX2, FMA and F16C, and g++ builds it; XLA's product otherwise. `kernel`
  raises instead of falling back when it cannot be built. Lowering for another platform (GPU export) always takes
  XLA's product.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import jax
import jax.numpy as jnp

from kernels_pallas.trace_setting import TraceSetting
from specjax.cpu_native import register, unsupported_reason  # noqa: F401 (re-exported)

ENV_VAR = "SPECJAX_CPU_MATMUL"
SETTINGS = ("auto", "kernel", "xla")
TARGET = "specjax_rows_matmul"  # the float32-weight target; the float16 one adds "_f16"
TARGETS = {jnp.dtype(jnp.float32): TARGET,
           jnp.dtype(jnp.float16): "specjax_rows_matmul_f16"}
# Up to this many rows the kernel (up to 14 rows per pass over the weight with AVX-512, 8 with
# AVX2, the later passes from cache) beats XLA's GEMM or ties with it (README, "What one verify
# pass costs").
MAX_ROWS = 64
_SETTING = TraceSetting(ENV_VAR, SETTINGS, "CPU matmul setting")
# Draft networks' weights: `auto` = float16 when the kernel takes their products (half_weights).
DRAFT_ENV_VAR = "SPECJAX_DRAFT_WEIGHTS"
_DRAFT_SETTING = TraceSetting(DRAFT_ENV_VAR, ("auto", "float32"), "draft weights setting")


def use_draft_weights(name: str):
    """Force draft weights `auto` or `float32` inside a `with` block (proposers made there)."""
    return _DRAFT_SETTING.use(name)


def cpu_matmul_setting() -> str:
    """The innermost `use_cpu_matmul`, else $SPECJAX_CPU_MATMUL (default auto)."""
    return _SETTING.get()


def use_cpu_matmul(name: str):
    """Force `name` (one of SETTINGS) inside a `with` block (clears JAX's caches)."""
    return _SETTING.use(name)


def kernel_in_use() -> bool:
    """Whether float32 products of at most MAX_ROWS rows traced now take the kernel."""
    setting = cpu_matmul_setting()
    if setting == "xla":
        return False
    if setting == "auto" and (jax.default_backend() != "cpu" or jax.device_count() != 1):
        return False
    reason = register()
    if reason is None:
        return True
    if setting == "kernel":
        raise RuntimeError(f"CPU matmul kernel unavailable: {reason}")
    _warn_once(reason)
    return False


def kernel_applies(x, w, out_dtype=None) -> bool:
    """Whether `linear` takes the kernel for x [M, K] times w [N, K] (decided at trace time)."""
    fits = (x.ndim == 2 and w.ndim == 2 and x.dtype == jnp.float32 and w.dtype in TARGETS
            and out_dtype in (None, jnp.float32) and 1 <= x.shape[0] <= MAX_ROWS
            and w.shape[0] >= 1)
    return fits and kernel_in_use()


def half_weights(tree):
    """`tree` with its 2-D float32 matrices as float16 when the kernel takes products now, else
    unchanged: for a draft network, whose products then stream half the bytes (a float16 weight
    is widened exactly in registers). Rounding a proposer's weights changes what it drafts, never
    the output, which the target verifies. Kept float32 if a value does not fit float16, or
    with $SPECJAX_DRAFT_WEIGHTS=float32 (or inside `use_draft_weights("float32")`)."""
    if _DRAFT_SETTING.get() == "float32" or not kernel_in_use():
        return tree
    mats = [a for a in jax.tree_util.tree_leaves(tree)
            if getattr(a, "ndim", 0) == 2 and a.dtype == jnp.float32]
    if not all(bool(jnp.all(jnp.abs(a) <= jnp.finfo(jnp.float16).max)) for a in mats):
        return tree
    return jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float16) if getattr(a, "ndim", 0) == 2 and a.dtype == jnp.float32
        else a, tree)


@lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    warnings.warn(f"specjax: CPU matmul kernel not used ({reason}); XLA's product runs instead",
                  RuntimeWarning, stacklevel=3)


def _xla_rows(x, w):
    return jax.lax.dot_general(x, w.astype(jnp.float32), (((1,), (1,)), ((), ())))


def _ffi_rows(x, w):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[w.dtype], out, vmap_method="sequential")(x, w)


@jax.custom_vjp
def rows_matmul(x, w):
    """x [M, K] float32 times w [N, K]^T (float32 or float16) -> [M, N] float32: the kernel on
    CPU, XLA's product elsewhere."""
    return jax.lax.platform_dependent(x, w, cpu=_ffi_rows, default=_xla_rows)


def _fwd(x, w):
    return rows_matmul(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    return g @ w.astype(jnp.float32), (g.T @ x).astype(w.dtype)


rows_matmul.defvjp(_fwd, _bwd)
