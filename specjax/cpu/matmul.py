"""Matrix products of a few rows on CPU through a native kernel (`rows_matmul.cc`).

A decode, verify or draft pass multiplies a handful of rows by every weight, so it is bound by
streaming the weights from memory; XLA:CPU's GEMM packs the weight and turns compute-bound from a
few rows on, which made a 4-token verify cost ~1.4x a decode step and capped every method's
speedup (docs/cpu.md, "Why"). The kernel reads each weight once for all rows, in panels of 32
rows (`PackedWeight`) streamed with prefetch, and computes each output the same way whatever
the row count: a row's product is bit-identical in a one-token decode and in a T-token verify.
`load_model` packs a model's weights once (`pack_params`); a plain [N, K] weight is packed on
the way, a copy per call.

The kernel is built with the machine's g++ on first use (`specjax.cpu.native`) and called as an
XLA FFI custom call. Chosen when a function is traced:
- `SPECJAX_CPU_MATMUL` (`specjax.settings`) = `auto` (default) | `kernel` | `xla`;
  `use_cpu_matmul(name)` overrides it inside a `with` block.
- `auto` uses the kernel for float32 rows times float32, float16 or int8 weights (widened
  exactly in registers: a float16 weight streams half the bytes, an int8 one a quarter), at
  most `MAX_ROWS` rows of a plain weight and any number of a packed one (int8 weights are
  packed only, with their scales), when the process has a single device (a custom call cannot be
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
import numpy as np

from specjax.cpu.native import register, unsupported_reason  # noqa: F401 (re-exported)
from specjax.settings import CPU_MATMUL as _SETTING

ENV_VAR = _SETTING.name
SETTINGS = _SETTING.choices
TARGET = "specjax_rows_matmul"  # the float32-weight target; float16 adds "_f16", int8 "_s8"
TARGETS = {
    jnp.dtype(jnp.float32): TARGET,
    jnp.dtype(jnp.float16): "specjax_rows_matmul_f16",
    jnp.dtype(jnp.int8): "specjax_rows_matmul_s8",
}
# Up to this many rows of a plain weight the kernel (up to 14 rows per pass over the weight with
# AVX-512, 6 with AVX2, the later passes from cache) takes the product, packing the weight on the
# way; more (an unpacked model's prefill, training batches) take XLA's GEMM.
MAX_ROWS = 64


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
    fits = (
        x.ndim == 2
        and w.ndim == 2
        and x.dtype == jnp.float32
        and w.dtype in TARGETS
        and (w.dtype != jnp.int8 or isinstance(w, PackedWeight))  # int8 needs its scale
        and out_dtype in (None, jnp.float32)
        and x.shape[0] >= 1
        and w.shape[0] >= 1
        and (x.shape[0] <= MAX_ROWS or isinstance(w, PackedWeight))
    )
    return fits and kernel_in_use()


def int8_weight(w) -> PackedWeight:
    """w [N, K] rounded to int8 row by row (symmetric: scale = max |row| / 127), packed."""
    w = as_array(w).astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=1) / 127
    scale = jnp.where(scale > 0, scale, 1.0)
    q = pack_weight(jnp.clip(jnp.round(w / scale[:, None]), -127, 127).astype(jnp.int8))
    pad = q.panels.shape[0] * PANEL - w.shape[0]
    return PackedWeight(q.panels, q.rows, jnp.pad(scale, (0, pad), constant_values=1.0))


@lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    warnings.warn(
        f"specjax: CPU matmul kernel not used ({reason}); XLA's product runs instead", RuntimeWarning, stacklevel=3
    )


PANEL = 32  # weight rows per panel of the kernel's layout


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels", "scale"], meta_fields=["rows"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight [rows, K] in the kernel's layout: panels [ceil(rows / 32), K, 32], panel q holding
    rows 32q .. 32q + 31 (zero-padded) with k outermost, so the kernel reads each panel as one
    stream and accumulates 32 outputs in vector lanes (`rows_matmul.cc`).

    Made once when a model is loaded for the kernel (`pack_params`, `specjax.cpu.draft_weights`);
    `linear` and `head_logits` take it where they take a [rows, K] weight. An int8 weight carries
    a float32 `scale` per row (padded to whole panels): row n is panels' row n times scale[n]."""

    panels: jax.Array
    rows: int
    scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.panels.shape[1])

    @property
    def dtype(self):
        return self.panels.dtype

    ndim = 2

    def unpack(self) -> jax.Array:
        """The weight as [rows, K] (an int8 weight float32, times its scale)."""
        p, k, _ = self.panels.shape
        w = jnp.swapaxes(self.panels, 1, 2).reshape(p * PANEL, k)[: self.rows]
        return w if self.scale is None else w.astype(jnp.float32) * self.scale[: self.rows, None]


def pack_weight(w) -> PackedWeight:
    """w [N, K] (float32 or float16) in the kernel's panel layout."""
    if isinstance(w, PackedWeight):
        return w
    n, k = w.shape
    pad = -n % PANEL
    # a NumPy weight is packed in NumPy: a constant in a trace, not a transpose run every call
    xp = np if isinstance(w, np.ndarray) else jnp
    w = xp.pad(w, ((0, pad), (0, 0))) if pad else xp.asarray(w)
    panels = xp.swapaxes(w.reshape(-1, PANEL, k), 1, 2)
    return PackedWeight(np.ascontiguousarray(panels) if xp is np else panels, n)


def take_rows(w, ids):
    """Rows `ids` (any shape) of a weight [N, K], packed or not: [*ids.shape, K] (token
    embeddings, a draft vocabulary's head rows)."""
    if isinstance(w, PackedWeight):
        ids = jnp.asarray(ids)
        rows = w.panels[ids // PANEL, :, ids % PANEL]
        return rows if w.scale is None else rows.astype(jnp.float32) * w.scale[ids][..., None]
    return w[ids]


def as_array(w):
    """A weight as a plain [N, K] array (unpacked if packed)."""
    return w.unpack() if isinstance(w, PackedWeight) else w


def pack_params(params):
    """Model parameters (`specjax.model`) with every linear weight and the output head packed
    for the kernel (`PackedWeight`), when the kernel takes products now; else unchanged.

    The embedding stays [V, D] for token lookups (a row of the panels would be one strided read
    per hidden unit); a tied model's head is packed
    beside it as `tied_head` (`specjax.model.lm_head_weight` reads it)."""
    if not kernel_in_use() or params["embed"].dtype != jnp.float32:
        return params
    layers = [pack_layer(layer) for layer in params["layers"]]
    head = "lm_head" if "lm_head" in params else "tied_head"
    return {**params, "layers": layers, head: pack_weight(params.get("lm_head", params["embed"]))}


def pack_layer(layer: dict) -> dict:
    """A decoder layer's parameters with every matrix packed (`pack_weight`; NumPy ones in
    NumPy, so a loader can pack each layer on the host as it reads it)."""
    return {k: pack_weight(v) if getattr(v, "ndim", 0) == 2 else v for k, v in layer.items()}


def unpack_params(params):
    """`pack_params` undone: every weight a plain array (training differentiates and casts
    them); no-op on plain parameters."""
    layers = [{k: as_array(v) for k, v in layer.items()} for layer in params["layers"]]
    plain = {k: v for k, v in params.items() if k != "tied_head"}
    return {**plain, "layers": layers, **{k: as_array(params[k]) for k in ("embed", "lm_head") if k in params}}


def _xla_rows(rows, x, panels, scale=None):
    w = PackedWeight(panels, rows, scale).unpack()
    return jax.lax.dot_general(x, w.astype(jnp.float32), (((1,), (1,)), ((), ())))


def _ffi_rows(rows, x, panels, scale=None):
    out = jax.ShapeDtypeStruct((x.shape[0], rows), jnp.float32)
    args = (x, panels) if scale is None else (x, panels, scale)
    return jax.ffi.ffi_call(TARGETS[panels.dtype], out, vmap_method="sequential")(*args)


def rows_matmul(x, w):
    """x [M, K] float32 times w^T, w [N, K] (float32 or float16, plain or `PackedWeight`)
    -> [M, N] float32: the kernel on CPU, XLA's product elsewhere. A plain weight is packed on
    the way (a copy per call: load models with `pack_params` to pack once)."""
    return _packed_rows(x, pack_weight(w))


@jax.custom_vjp
def _packed_rows(x, w: PackedWeight):
    args = (x, w.panels) if w.scale is None else (x, w.panels, w.scale)
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(_ffi_rows, w.rows), default=functools.partial(_xla_rows, w.rows)
    )


def _fwd(x, w):
    return _packed_rows(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    if w.scale is not None:
        raise TypeError("products with an int8 PackedWeight are not differentiable")
    dw = pack_weight((g.T @ x).astype(w.dtype))
    return g @ w.unpack().astype(jnp.float32), dw


_packed_rows.defvjp(_fwd, _bwd)
