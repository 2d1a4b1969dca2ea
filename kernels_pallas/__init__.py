"""Attention over the paged KV cache: Pallas GPU kernels, each beside its XLA reference.

The model calls `paged_attention`, which runs the Pallas kernel on a CUDA GPU (compute
capability >= 8.0), specjax's native CPU kernel (`specjax.cpu_attention`) on one CPU device, and
the XLA reference elsewhere; see `dispatch` for the settings.
"""

from kernels_pallas.tree_paged_attention_reference import (
    attention_with_new_rows,
    gather_pages,
    gathered_attention,
    tree_paged_attention_reference,
    unwritten_keys_mask,
    visible_keys_mask,
)
from kernels_pallas.paged_kv_write import write_paged_kv
from kernels_pallas.tree_paged_attention import tree_paged_attention, unsupported_reason
from kernels_pallas.dispatch import (
    attention_backend,
    attention_mesh,
    on_cpu_path,
    attention_setting,
    paged_attention,
    use_attention_backend,
    uses_pallas,
)

__all__ = [
    "attention_backend", "attention_mesh", "attention_setting", "attention_with_new_rows",
    "gather_pages", "gathered_attention", "on_cpu_path", "paged_attention",
    "tree_paged_attention", "tree_paged_attention_reference", "unsupported_reason",
    "unwritten_keys_mask", "use_attention_backend", "uses_pallas", "visible_keys_mask",
    "write_paged_kv",
]
