"""Whether two checkouts compile the same programs: `specjax generate` runs in each with XLA's
HLO dump on (compile cache off), and the optimized modules are compared as text without debug
information (source locations, stack frames). Identical programs run at identical speed, so a
refactor that leaves them unchanged needs no speed re-measurement, which on a 2-core guest is
noisier than the effects it looks for.

    python benchmarks/compare_programs.py --before /tmp/checkout-at-OLD --methods vanilla eagle2
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def normalized(text: str) -> str:
    """An HLO module's text without its debug information."""
    text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)
    text = re.sub(r"(?m)^(FileNames|FunctionNames|FileLocations|StackFrames)\s*$", "", text)
    text = re.sub(r"(?m)^\d+ (\"[^\n]*\"|\{[^\n]*\})\s*$", "", text)
    text = re.sub(r",?\s*stack_frame_id=\d+", "", text)
    return re.sub(r"\n\s*\n+", "\n", text)


def programs(checkout: Path, method: str, dump: Path) -> collections.Counter:
    """(module name, hash of its normalized text) of every program one generate run compiles."""
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "SPECJAX_COMPILE_CACHE": "0",
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
    }
    cmd = [
        sys.executable,
        "-m",
        "specjax.cli",
        "generate",
        "--method",
        method,
        "--prompt",
        "Write a haiku about the sea.",
        "--max-new-tokens",
        "8",
        "--no-warmup",
    ]
    subprocess.run(cmd, cwd=checkout, env=env, check=True, capture_output=True)
    out = collections.Counter()
    for f in dump.glob("*.cpu_after_optimizations.txt"):
        name = re.sub(r"^module_\d+\.", "", f.name).split(".")[0]
        out[(name, hashlib.sha256(normalized(f.read_text()).encode()).hexdigest())] += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout of the earlier commit")
    ap.add_argument("--after", default=str(ROOT), help="a checkout of the later one (default: this)")
    ap.add_argument("--methods", nargs="+", default=["vanilla", "eagle2", "medusa"])
    ap.add_argument("--out", default=None, help="a JSON file for the result")
    args = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.methods:
            b = programs(Path(args.before), m, Path(tmp) / f"before_{m}")
            a = programs(Path(args.after), m, Path(tmp) / f"after_{m}")
            res[m] = {
                "before": sum(b.values()),
                "after": sum(a.values()),
                "identical": sum((a & b).values()),
                "only_before": sorted(k[0] for k in b - a),
                "only_after": sorted(k[0] for k in a - b),
            }
            print(m, json.dumps(res[m]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
