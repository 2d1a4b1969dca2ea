"""Public DFlash drafters (z-lab/dflash; e.g. z-lab/Qwen3-8B-DFlash-b16) -> specjax "dflash" heads;
the format itself is read by `specjax.proposers.dflash_format`."""

from __future__ import annotations

from pathlib import Path

from specjax.proposers.dflash_format import WEIGHTS, is_public_dflash_dir, read_dflash
from specjax.proposers.dflash_net import save_dflash_heads


def is_dflash_dir(path: Path) -> bool:
    """A directory holding a public DFlash drafter (its config names one, fc and hidden_norm)."""
    return is_public_dflash_dir(path) and (Path(path) / WEIGHTS).is_file()


def convert_dflash(src, out) -> Path:
    """Write the public DFlash drafter at SRC as a specjax "dflash" head checkpoint at OUT."""
    config, net, meta = read_dflash(Path(src))
    return save_dflash_heads(out, config, net, meta)
