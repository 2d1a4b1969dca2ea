"""The type draft networks' weights take on the CPU matmul kernel: float32, float16 or int8.

A draft network's few-row products stream each weight from memory, so narrower weights draft
faster: float16 streams half the bytes (widened exactly in registers), int8 a quarter (rounded
per row, `specjax.cpu.matmul.int8_weight`). Rounding a proposer's weights changes what it
drafts, never the output, which the target verifies. Chosen when a proposer is made:
`SPECJAX_DRAFT_WEIGHTS` (`specjax.settings`) = `auto` (DRAFT_AUTO) | `float32` | `float16` |
`int8`; `use_draft_weights(name)` overrides it inside a `with` block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.cpu.matmul import PackedWeight, as_array, int8_weight, kernel_in_use, pack_weight
from specjax.settings import DRAFT_WEIGHTS as _DRAFT_SETTING

DRAFT_ENV_VAR = _DRAFT_SETTING.name
DRAFT_SETTINGS = _DRAFT_SETTING.choices
DRAFT_AUTO = "int8"  # what `auto` means


def use_draft_weights(name: str):
    """Force draft weights to `name` (one of DRAFT_SETTINGS) inside a `with` block (proposers
    made there)."""
    return _DRAFT_SETTING.use(name)


def draft_weights(tree):
    """`tree` with its 2-D float32 matrices packed for the kernel (`PackedWeight`) in the draft
    weights setting's type, when the kernel takes products now; else unchanged. For a draft
    network, whose few-row products stream each weight from memory: float16 streams half the
    bytes (widened exactly in registers), int8 a quarter (rounded per row, `int8_weight`).
    Rounding a proposer's weights changes what it drafts, never the output, which the target
    verifies. $SPECJAX_DRAFT_WEIGHTS (or `use_draft_weights`): auto (DRAFT_AUTO), float32,
    float16 (kept float32 if a value does not fit) or int8."""
    if not kernel_in_use():
        return tree
    is_mat = lambda a: isinstance(a, PackedWeight) or (getattr(a, "ndim", 0) == 2 and a.dtype == jnp.float32)
    mats = [a for a in jax.tree_util.tree_leaves(tree, is_leaf=is_mat) if is_mat(a)]
    kind = _DRAFT_SETTING.get()
    kind = DRAFT_AUTO if kind == "auto" else kind
    if kind == "float16" and not all(bool(jnp.all(jnp.abs(as_array(a)) <= jnp.finfo(jnp.float16).max)) for a in mats):
        kind = "float32"

    def convert(a):
        if not is_mat(a) or a.dtype != jnp.float32:
            return a
        if kind == "int8":
            return int8_weight(a)
        a = pack_weight(a)
        return PackedWeight(a.panels.astype(jnp.float16), a.rows) if kind == "float16" else a

    return jax.tree_util.tree_map(convert, tree, is_leaf=is_mat)
