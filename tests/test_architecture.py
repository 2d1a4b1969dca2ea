"""The module graph has no cycle, function-level imports included: every module of specjax/,
training/, convert/ and kernels_pallas/ (installed as specjax.training, specjax.convert and
specjax.kernels_pallas) can be read (and changed) knowing only what it imports. The layers hold
(docs/architecture.md), keyed on module prefix: specjax.kernels_pallas imports nothing of the
project, the core imports specjax.training and specjax.convert only from the modules named in
`UPWARD`, and only specjax/settings.py reads the environment.

(Importing `a.b` also runs package `a`'s __init__; that implicit edge is not counted, as a
package's __init__ only gathers its modules' public names.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each package's folder (pyproject.toml's package-dir) and module prefix.
PACKAGES = {
    "specjax": "specjax",
    "training": "specjax.training",
    "convert": "specjax.convert",
    "kernels_pallas": "specjax.kernels_pallas",
}
KERNELS = "specjax.kernels_pallas"
UPPER = ("specjax.training", "specjax.convert")  # the layers above the core
# The core modules allowed to import a package of a higher layer, and why.
UPWARD = {
    "specjax.cli": set(UPPER),  # the command's `train` and `convert` subcommands
    "specjax.loading": {"specjax.convert"},  # embedded models and GGUF files are converted on load
}


def layer(module: str) -> str:
    """The package a module belongs to: its longest matching prefix in PACKAGES."""
    return max((p for p in PACKAGES.values() if module == p or module.startswith(p + ".")), key=len)


def modules() -> dict[str, Path]:
    out = {}
    for folder, prefix in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((prefix, *parts))] = f
    return out


def imported(name: str, path: Path, known) -> set[str]:
    """The project modules `name` imports anywhere in its body (resolved to the longest known
    module name: `from specjax.model import forward` -> specjax.model)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] or [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    mods = modules()
    graph = {m: imported(m, f, mods) for m, f in mods.items()}
    assert len(graph) > 50
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in found
    )


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_step_reads_proposer_attributes_without_fallbacks():
    """The proposer contract is explicit (`spec_decode.ProposerBase`): no getattr(proposer, ...)."""
    hits = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in (ROOT / "specjax").rglob("*.py")
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if "getattr(proposer" in line
    ]
    assert not hits, hits


def test_kernels_pallas_imports_nothing_of_the_project():
    """kernels_pallas/ is the lowest layer: the backend choice lives in specjax.attention."""
    mods = modules()
    found = {
        m: sorted(t for t in imported(m, f, mods) if layer(t) != KERNELS)
        for m, f in mods.items()
        if layer(m) == KERNELS
    }
    assert len(found) >= 4
    assert not any(found.values()), {m: t for m, t in found.items() if t}


def test_specjax_imports_training_and_convert_only_where_allowed():
    mods = modules()
    found = {}
    for m, f in mods.items():
        if layer(m) != "specjax":
            continue
        up = {layer(t) for t in imported(m, f, mods)} & set(UPPER)
        if up - UPWARD.get(m, set()):
            found[m] = sorted(up)
    assert not found, found


def test_only_settings_reads_the_environment():
    """Every SPECJAX_* variable (and CXX) is declared and read in specjax/settings.py."""
    reads = ("environ.get(", "environ[", "getenv(")
    hits = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in modules().values()
        if f != ROOT / "specjax" / "settings.py"
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if any(r in line for r in reads)
    ]
    assert not hits, hits


def test_docs_list_every_setting():
    from specjax.settings import CXX, VARIABLES

    text = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"| `{v.name}` |" in text for v in (*VARIABLES, CXX))


def module_summaries() -> str:
    """Each module's path and its docstring's first paragraph (markdown list lines)."""
    lines = []
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        lines.append(f"- `{path.relative_to(ROOT)}` (`{name}`): {summary}")
    return "\n".join(lines) + "\n"


def test_docs_list_every_module_in_one_sentence():
    """docs/architecture.md's module list is the modules' own summaries: every module has one,
    and the list cannot drift from the code."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    begin = "<!-- modules: generated by tests/test_architecture.py::module_summaries -->\n"
    listed = text[text.index(begin) + len(begin) : text.index("<!-- end of the modules -->")]
    assert all(": " in line and not line.endswith(": ") for line in module_summaries().splitlines())
    assert listed == module_summaries(), "paste tests/test_architecture.py's module_summaries() in"
