"""Package trained heads for the project: float16 weights, recommended decoding settings, a card.

    python -m specjax.training.ship RUN/heads specjax/shipped_heads/smollm2-135m/eagle \
        --defaults '{"eagle2": {"eagle_total_tokens": 8}}' --card card.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def ship_heads(src, dst, decoding_defaults: dict | None = None, card: str | None = None) -> Path:
    """Copy a specjax head checkpoint to dst with floating weights in float16 (half the size;
    loaders cast to the model's dtype), `decoding_defaults` added to its metadata, and README.md."""
    from safetensors.numpy import load_file, save_file

    from specjax.checkpoint import FORMAT_FILE, atomic_dir, finish_dir
    from specjax.heads import HEADS_FILE, load_heads

    src, dst = Path(src), Path(dst)
    meta, _ = load_heads(src)  # checks it is a head checkpoint
    tensors = load_file(str(src / HEADS_FILE))
    small = {k: v.astype(np.float16) if np.issubdtype(v.dtype, np.floating) else v for k, v in tensors.items()}
    tmp = atomic_dir(dst)
    save_file(small, str(tmp / HEADS_FILE))
    raw = json.loads((src / FORMAT_FILE).read_text())
    if decoding_defaults:
        raw["decoding_defaults"] = decoding_defaults
    raw["weights_dtype"] = "float16"
    (tmp / FORMAT_FILE).write_text(json.dumps(raw, indent=2) + "\n")
    if card:
        (tmp / "README.md").write_text(card)
    finish_dir(tmp, dst)
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument(
        "--defaults", default=None, help="JSON {method: {make_proposer option: value}}, or a file holding it"
    )
    ap.add_argument("--card", default=None, help="a markdown file to ship as README.md")
    args = ap.parse_args(argv)
    card = Path(args.card).read_text() if args.card else None
    defaults = None
    if args.defaults:
        try:
            defaults = json.loads(args.defaults)
        except json.JSONDecodeError:
            try:
                defaults = json.loads(Path(args.defaults).read_text())
            except (OSError, json.JSONDecodeError) as e:
                ap.error(f"--defaults is neither a JSON object nor a file holding one ({e})")
        if not isinstance(defaults, dict):
            ap.error("--defaults is neither a JSON object nor a file holding one")
    print(ship_heads(args.src, args.dst, defaults, card))


if __name__ == "__main__":
    main()
