"""Hugging Face model directories <-> specjax checkpoints (GGUF files and embedded names too)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from specjax.checkpoint import (CheckpointError, is_specjax_checkpoint, load_checkpoint, save_hf,
                                save_specjax)


def convert_checkpoint(src: str | Path, out: str | Path, to: str | None = None) -> Path:
    """Convert SRC (HF dir, specjax dir, .gguf file, embedded name, FasterDecoding Medusa heads
    or SafeAILab EAGLE-1/2/3 heads) into `to` format at OUT.

    `to` defaults to specjax, or to hf when SRC is already a specjax checkpoint.
    """
    from specjax.loading import resolve_model_path

    out = Path(out)
    from convert.medusa import convert_medusa, is_medusa_dir

    from convert.eagle import convert_eagle, is_eagle_dir

    if Path(src).is_dir() and is_medusa_dir(Path(src)):  # public draft-head formats
        return convert_medusa(src, out)
    from convert.eagle3 import convert_eagle3, is_eagle3_dir

    if Path(src).is_dir() and is_eagle3_dir(Path(src)):  # SafeAILab EAGLE-3 (before EAGLE-1/2)
        return convert_eagle3(src, out)
    if Path(src).is_dir() and is_eagle_dir(Path(src)):
        return convert_eagle(src, out)
    from convert.redrafter import convert_redrafter, is_redrafter_dir

    if Path(src).is_dir() and is_redrafter_dir(Path(src)):  # apple/ml-recurrent-drafter
        return convert_redrafter(src, out)
    path = resolve_model_path(str(src))
    if to is None:
        to = "hf" if is_specjax_checkpoint(path) else "specjax"
    if to not in ("specjax", "hf"):
        raise CheckpointError(f"unknown output format '{to}' (specjax or hf)")
    if out.resolve() == path.resolve():
        raise CheckpointError(f"--out {out} is the source directory")
    params, config, hf_config = load_checkpoint(path)
    save = save_specjax if to == "specjax" else save_hf
    return save(out, params, config, hf_config=hf_config, tokenizer_dir=path)
