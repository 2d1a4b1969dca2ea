"""One attention entry point for the model: the Pallas kernel on GPU, the XLA reference elsewhere.

The backend is chosen when a function is traced:
- `SPECJAX_ATTENTION` = `auto` (default) | `pallas` | `pallas-interpret` | `xla` sets it for the
  process; `use_attention_backend(name)` overrides it inside a `with` block (tests, debugging).
- `auto` runs the kernel when JAX's default backend is a CUDA GPU of compute capability >= 8.0
  and the shapes suit it (`unsupported_reason`), the reference otherwise. A forced `pallas` or
  `pallas-interpret` raises on shapes the kernel cannot take instead of falling back silently.

Functions that jax.jit already traced keep the backend they were traced with, so
`use_attention_backend` clears JAX's compilation caches on entry and exit.
"""

from __future__ import annotations

import jax

from kernels_pallas.tree_paged_attention import tree_paged_attention, unsupported_reason
from kernels_pallas.tree_paged_attention_reference import tree_paged_attention_reference
from kernels_pallas.trace_setting import TraceSetting

ENV_VAR = "SPECJAX_ATTENTION"
SETTINGS = ("auto", "pallas", "pallas-interpret", "xla")
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


def attention_backend() -> str:
    """The backend attention runs on now: "pallas", "pallas-interpret" or "xla"."""
    setting = attention_setting()
    if setting == "auto":
        return "pallas" if gpu_supports_kernel() else "xla"
    return setting


def paged_attention(q, k_pages, v_pages, block_tables, lengths, tree_mask, *, scale=None,
                    key_mask=None):
    """Tree-masked attention over the paged cache on the selected backend ([B, T, H, D]).

    Arguments as `tree_paged_attention_reference`. Pass key_mask only when it hides more than
    lengths and tree_mask do (sliding windows), and only as a subset of
    `visible_keys_mask(lengths, tree_mask)`: the kernel then reads it tile by tile; without it
    the kernel builds the mask itself and reads no mask bytes.
    """
    backend = attention_backend()
    if backend != "xla":
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
