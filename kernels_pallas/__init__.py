"""Attention over the paged KV cache: the Pallas GPU kernel beside its XLA reference, and the
paged K/V write.

This package imports nothing from specjax: the model calls `specjax.attention.paged_attention`,
which chooses the backend (the kernel here on a CUDA GPU of compute capability >= 8.0, specjax's
native CPU kernel on one CPU device, the reference here elsewhere).
"""

from specjax.kernels_pallas.paged_kv_write import write_paged_kv
from specjax.kernels_pallas.tree_paged_attention import tree_paged_attention, unsupported_reason
from specjax.kernels_pallas.tree_paged_attention_reference import (
    attention_with_new_rows,
    gather_pages,
    gathered_attention,
    tree_paged_attention_reference,
    unwritten_keys_mask,
    visible_keys_mask,
)

__all__ = [
    "attention_with_new_rows",
    "gather_pages",
    "gathered_attention",
    "tree_paged_attention",
    "tree_paged_attention_reference",
    "unsupported_reason",
    "unwritten_keys_mask",
    "visible_keys_mask",
    "write_paged_kv",
]
