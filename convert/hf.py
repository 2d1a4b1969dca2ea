"""Hugging Face model directories <-> specjax checkpoints (GGUF files and embedded names too)."""

from __future__ import annotations

from pathlib import Path

from specjax.checkpoint import CheckpointError, is_specjax_checkpoint, param_pieces, read_config, save_hf, save_specjax


def _head_converters():
    """(detector, converter) of each public draft-head format, most specific first."""
    from specjax.convert.dflash import convert_dflash, is_dflash_dir
    from specjax.convert.eagle import convert_eagle, is_eagle_dir
    from specjax.convert.eagle3 import convert_eagle3, is_eagle3_dir
    from specjax.convert.medusa import convert_medusa, is_medusa_dir
    from specjax.convert.redrafter import convert_redrafter, is_redrafter_dir

    return (
        (is_medusa_dir, convert_medusa),  # FasterDecoding/Medusa
        (is_dflash_dir, convert_dflash),  # z-lab DFlash (an fc and hidden_norm: before EAGLE)
        (is_eagle3_dir, convert_eagle3),  # SafeAILab EAGLE-3 (also has an fc: before EAGLE)
        (is_eagle_dir, convert_eagle),  # SafeAILab EAGLE-1/2
        (is_redrafter_dir, convert_redrafter),
    )  # apple/ml-recurrent-drafter


def convert_checkpoint(src: str | Path, out: str | Path, to: str | None = None) -> Path:
    """Convert SRC (HF dir, specjax dir, .gguf file, embedded name, or draft heads: FasterDecoding
    Medusa, SafeAILab EAGLE-1/2/3, apple ReDrafter, z-lab DFlash) into `to` format at OUT.

    `to` defaults to specjax, or to hf when SRC is already a specjax checkpoint; draft heads
    always become a specjax head checkpoint.
    """
    from specjax.loading import resolve_model_path

    out = Path(out)
    if Path(src).is_dir():
        for detect, convert in _head_converters():
            if detect(Path(src)):
                return convert(src, out)
    path = resolve_model_path(str(src))
    if to is None:
        to = "hf" if is_specjax_checkpoint(path) else "specjax"
    if to not in ("specjax", "hf"):
        raise CheckpointError(f"unknown output format '{to}' (specjax or hf)")
    if out.resolve() == path.resolve():
        raise CheckpointError(f"--out {out} is the source directory")
    config, hf_config = read_config(path)
    save = save_specjax if to == "specjax" else save_hf
    # piece by piece from the source file to the output file, in the dtypes stored
    return save(out, param_pieces(path, config, dtype=None), config, hf_config=hf_config, tokenizer_dir=path)
