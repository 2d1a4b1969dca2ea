"""A code-edit workload built from the Python standard library's own sources: short functions,
each given four editing tasks in turn (add type hints, add a docstring, rename a parameter,
comment each statement), as an agent editing one file step by step asks. Answers repeat the
function with small changes, so they repeat each other and the prompt: the workload of suffix
decoding's global cache.

    python benchmarks/code_edit_prompts.py            # writes benchmarks/data/code_edit.jsonl
    specjax bench --prompts benchmarks/data/code_edit.jsonl --methods vanilla,pld,suffix --warm-cache

Functions are the first `--functions` (one per module in turn, by name) of 6 to 16 source lines among
`MODULES`, so the set is the same wherever this Python version runs; the file records the
version it was built from.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys
import textwrap
from pathlib import Path

MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq", "statistics", "calendar", "string")
TASKS = {
    "type-hints": "Add type hints to every parameter and to the return value.",
    "docstring": "Add a docstring that says what the function does and what it returns.",
    "rename": "Rename the parameter `{param}` to `{param}_value` everywhere in the function.",
    "comments": "Add a short comment above each statement that says what it does.",
}


def functions(limit: int):
    """(module, name, source, first parameter) of short top-level functions with a parameter,
    taken from each module in turn."""
    by_module = []
    for module_name in MODULES:
        found = []
        module = importlib.import_module(module_name)
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError):
            continue
        for node in sorted(tree.body, key=lambda n: getattr(n, "name", "")):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.args.args:
                continue
            source = textwrap.dedent(ast.get_source_segment(inspect.getsource(module), node))
            if 6 <= len(source.splitlines()) <= 16:
                found.append((module_name, node.name, source, node.args.args[0].arg))
        by_module.append(found)
    turns = [f[i] for i in range(max(map(len, by_module))) for f in by_module if i < len(f)]
    return turns[:limit]


def prompts(limit: int) -> list[dict]:
    out = []
    for module, name, source, param in functions(limit):
        for category, task in TASKS.items():
            text = (
                f"Here is the function `{name}` from Python's `{module}` module:\n\n```python\n{source}\n```\n\n"
                f"{task.format(param=param)} Reply with the whole updated function in one code block."
            )
            out.append({"id": f"code-edit-{module}-{name}-{category}", "category": category, "turns": [text]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--functions", type=int, default=8, help="functions, each with every task")
    ap.add_argument("--out", default=str(Path(__file__).parent / "data" / "code_edit.jsonl"))
    args = ap.parse_args()
    records = prompts(args.functions)
    version = ".".join(map(str, sys.version_info[:3]))
    for r in records:
        r["source"] = f"Python {version} standard library"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} prompts ({args.functions} functions x {len(TASKS)} tasks) -> {args.out}")


if __name__ == "__main__":
    main()
