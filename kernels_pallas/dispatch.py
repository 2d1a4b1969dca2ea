"""One attention entry point for the model: the Pallas kernel on GPU, a native kernel on CPU,
the XLA reference elsewhere.

The backend is chosen when a function is traced:
- `SPECJAX_ATTENTION` = `auto` (default) | `pallas` | `pallas-interpret` | `cpu` | `xla` sets it
  for the process; `use_attention_backend(name)` overrides it inside a `with` block.
- `auto` runs the Pallas kernel when JAX's default backend is a CUDA GPU of compute capability
  >= 8.0 and the shapes suit it (`unsupported_reason`); on a single CPU device where the native
  kernels build, `specjax.cpu_attention` (float32 heads of a multiple of 64); the reference
  otherwise. A forced `pallas` or `pallas-interpret` raises on shapes the kernel cannot take
  instead of falling back silently; a forced `cpu` raises when the native kernel cannot build.

Functions that jax.jit already traced keep the backend they were traced with, so
`use_attention_backend` clears JAX's compilation caches on entry and exit.
"""

from __future__ import annotations

import jax

from kernels_pallas.tree_paged_attention import tree_paged_attention, unsupported_reason
from kernels_pallas.tree_paged_attention_reference import (tree_paged_attention_reference,
                                                           visible_keys_mask)
from kernels_pallas.trace_setting import TraceSetting

ENV_VAR = "SPECJAX_ATTENTION"
SETTINGS = ("auto", "pallas", "pallas-interpret", "cpu", "xla")
_SETTING = TraceSetting(ENV_VAR, SETTINGS, "attention backend")


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
    """True on a single CPU device where specjax's native kernels build (`specjax.cpu_native`)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    from specjax.cpu_native import register

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


def paged_attention(q, k_pages, v_pages, block_tables, lengths, tree_mask, *, scale=None,
                    key_mask=None):
    """Tree-masked attention over the paged cache on the selected backend ([B, T, H, D]).

    Arguments as `tree_paged_attention_reference`. Pass key_mask only when it hides more than
    lengths and tree_mask do (sliding windows), and only as a subset of
    `visible_keys_mask(lengths, tree_mask)`: the kernel then reads it tile by tile; without it
    the kernel builds the mask itself and reads no mask bytes.
    """
    backend = attention_backend()
    if backend == "cpu":
        from specjax.cpu_attention import cpu_paged_attention, kernel_applies

        if kernel_applies(q, k_pages):
            if key_mask is None:
                key_mask = visible_keys_mask(lengths, tree_mask,
                                             block_tables.shape[1] * k_pages.shape[2])
            return cpu_paged_attention(q, k_pages, v_pages, block_tables, key_mask, scale=scale)
    elif backend != "xla":
        reason = unsupported_reason(q, k_pages, tree_mask)
        if reason is None:
            return tree_paged_attention(q, k_pages, v_pages, block_tables, lengths, tree_mask,
                                        scale=scale, key_mask=key_mask,
                                        interpret=backend == "pallas-interpret")
        if attention_setting() != "auto":
            raise ValueError(f"attention backend {backend!r} forced, but the kernel cannot run: "
                             f"{reason}")
    return tree_paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, tree_mask,
                                          scale=scale, key_mask=key_mask)
