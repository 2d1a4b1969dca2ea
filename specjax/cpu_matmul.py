"""Matrix products of a few rows on CPU through a native kernel (`cpu_kernels/rows_matmul.cc`).

A decode, verify or draft pass multiplies a handful of rows by every weight, so it is bound by
streaming the weights from memory; XLA:CPU's GEMM packs the weight and turns compute-bound from a
few rows on, which made a 4-token verify cost ~1.4x a decode step and capped every method's
speedup (README, "What one verify pass costs"). The kernel reads each weight once for all rows,
in panels of 32 rows (`PackedWeight`) streamed with prefetch, and computes each output the same
way whatever the row count: a row's product is bit-identical in a one-token decode and in a
T-token verify. `load_model` packs a model's weights once (`pack_params`); a plain [N, K]
weight is packed on the way, a copy per call.

The kernel is built with the machine's g++ on first use (`specjax.cpu_native`) and called as an
XLA FFI custom call. Chosen when a function is traced:
- `SPECJAX_CPU_MATMUL` = `auto` (default) | `kernel` | `xla`; `use_cpu_matmul(name)` overrides
  it inside a `with` block.
- `auto` uses the kernel for float32 rows times float32 or float16 weights (widened exactly in
  registers: a float16 weight streams half the bytes), at most `MAX_ROWS` rows of a plain weight
  and any number of a packed one, when the process has a single device (a custom call cannot be
  split over a mesh by XLA's partitioner) on an x86-64 CPU with AVX2, FMA and F16C, and g++
  builds it; XLA's product otherwise. `kernel` raises instead of falling back when it cannot be
  built. Lowering for another platform (GPU export) always takes XLA's product.
"""

from __future__ import annotations

import dataclasses
import functools
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
# Up to this many rows of a plain weight the kernel (up to 14 rows per pass over the weight with
# AVX-512, 6 with AVX2, the later passes from cache) takes the product, packing the weight on the
# way; more (an unpacked model's prefill, training batches) take XLA's GEMM.
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
    """Whether `linear` takes the kernel for x [M, K] times w [N, K] (decided at trace time):
    up to MAX_ROWS rows, any number for a `PackedWeight` (a prefill's too)."""
    fits = (x.ndim == 2 and w.ndim == 2 and x.dtype == jnp.float32 and w.dtype in TARGETS
            and out_dtype in (None, jnp.float32) and x.shape[0] >= 1 and w.shape[0] >= 1
            and (x.shape[0] <= MAX_ROWS or isinstance(w, PackedWeight)))
    return fits and kernel_in_use()


def half_weights(tree):
    """`tree` with its 2-D float32 matrices packed for the kernel (`PackedWeight`) and in
    float16, when the kernel takes products now; else unchanged. For a draft network, whose
    products then stream half the bytes (a float16 weight is widened exactly in registers).
    Rounding a proposer's weights changes what it drafts, never the output, which the target
    verifies. Packed but kept float32 if a value does not fit float16, or with
    $SPECJAX_DRAFT_WEIGHTS=float32 (or inside `use_draft_weights("float32")`)."""
    if not kernel_in_use():
        return tree
    is_mat = lambda a: (isinstance(a, PackedWeight)  # noqa: E731
                        or (getattr(a, "ndim", 0) == 2 and a.dtype == jnp.float32))
    mats = [a for a in jax.tree_util.tree_leaves(tree, is_leaf=is_mat) if is_mat(a)]
    half = _DRAFT_SETTING.get() != "float32" and all(
        bool(jnp.all(jnp.abs(as_array(a)) <= jnp.finfo(jnp.float16).max)) for a in mats)

    def convert(a):
        if not is_mat(a) or a.dtype != jnp.float32:
            return a
        a = pack_weight(a)
        return PackedWeight(a.panels.astype(jnp.float16), a.rows) if half else a

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_mat)


@lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    warnings.warn(f"specjax: CPU matmul kernel not used ({reason}); XLA's product runs instead",
                  RuntimeWarning, stacklevel=3)


PANEL = 32  # weight rows per panel of the kernel's layout


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels"],
                   meta_fields=["rows"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight [rows, K] in the kernel's layout: panels [ceil(rows / 32), K, 32], panel q holding
    rows 32q .. 32q + 31 (zero-padded) with k outermost, so the kernel reads each panel as one
    stream and accumulates 32 outputs in vector lanes (`cpu_kernels/rows_matmul.cc`).

    Made once when a model is loaded for the kernel (`pack_params`, `half_weights`); `linear` and
    `head_logits` take it where they take a [rows, K] weight."""

    panels: jax.Array
    rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.panels.shape[1])

    @property
    def dtype(self):
        return self.panels.dtype

    ndim = 2

    def unpack(self) -> jax.Array:
        """The weight as [rows, K]."""
        p, k, _ = self.panels.shape
        return jnp.swapaxes(self.panels, 1, 2).reshape(p * PANEL, k)[:self.rows]


def pack_weight(w) -> PackedWeight:
    """w [N, K] (float32 or float16) in the kernel's panel layout."""
    if isinstance(w, PackedWeight):
        return w
    n, k = w.shape
    pad = -n % PANEL
    w = jnp.pad(w, ((0, pad), (0, 0))) if pad else jnp.asarray(w)
    return PackedWeight(jnp.swapaxes(w.reshape(-1, PANEL, k), 1, 2), n)


def take_rows(w, ids):
    """Rows `ids` (any shape) of a weight [N, K], packed or not: [*ids.shape, K] (token
    embeddings, a draft vocabulary's head rows)."""
    if isinstance(w, PackedWeight):
        ids = jnp.asarray(ids)
        return w.panels[ids // PANEL, :, ids % PANEL]
    return w[ids]


def as_array(w):
    """A weight as a plain [N, K] array (unpacked if packed)."""
    return w.unpack() if isinstance(w, PackedWeight) else w


def pack_params(params):
    """Model parameters (`specjax.model`) with every linear weight and the output head packed
    for the kernel (`PackedWeight`), when the kernel takes products now; else unchanged.

    A tied model's embedding is its head, so it is packed too: token lookups read its rows from
    the panels (`take_rows`); an untied model's embedding stays [V, D]."""
    if not kernel_in_use() or params["embed"].dtype != jnp.float32:
        return params
    layers = [{k: pack_weight(v) if getattr(v, "ndim", 0) == 2 else v for k, v in layer.items()}
              for layer in params["layers"]]
    head = "lm_head" if "lm_head" in params else "embed"
    return {**params, "layers": layers, head: pack_weight(params[head])}


def unpack_params(params):
    """`pack_params` undone: every weight a plain array (training differentiates and casts
    them); no-op on plain parameters."""
    layers = [{k: as_array(v) for k, v in layer.items()} for layer in params["layers"]]
    return {**params, "layers": layers,
            **{k: as_array(params[k]) for k in ("embed", "lm_head") if k in params}}


def _xla_rows(rows, x, panels):
    w = PackedWeight(panels, rows).unpack()
    return jax.lax.dot_general(x, w.astype(jnp.float32), (((1,), (1,)), ((), ())))


def _ffi_rows(rows, x, panels):
    out = jax.ShapeDtypeStruct((x.shape[0], rows), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[panels.dtype], out, vmap_method="sequential")(x, panels)


def rows_matmul(x, w):
    """x [M, K] float32 times w^T, w [N, K] (float32 or float16, plain or `PackedWeight`)
    -> [M, N] float32: the kernel on CPU, XLA's product elsewhere. A plain weight is packed on
    the way (a copy per call: load models with `pack_params` to pack once)."""
    return _packed_rows(x, pack_weight(w))


@jax.custom_vjp
def _packed_rows(x, w: PackedWeight):
    return jax.lax.platform_dependent(x, w.panels, cpu=functools.partial(_ffi_rows, w.rows),
                                      default=functools.partial(_xla_rows, w.rows))


def _fwd(x, w):
    return _packed_rows(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    dw = pack_weight((g.T @ x).astype(w.dtype))
    return g @ w.unpack().astype(jnp.float32), dw


_packed_rows.defvjp(_fwd, _bwd)
