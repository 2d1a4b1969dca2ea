"""Every relative link in README.md, docs/*.md and the shipped heads' model cards names a file or
folder of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "specjax" / "shipped_heads").glob("*/*/README.md")]
)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)


def relative_links(text: str) -> list[str]:
    """Link targets outside code blocks that point into the repository (no scheme, no anchor
    alone), without their #fragment."""
    text = _FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in _INLINE.findall(text) + _REFERENCE.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `path` that name nothing under `root`."""
    bad = []
    for target in relative_links(path.read_text(encoding="utf-8")):
        resolved = (path.parent / target).resolve()
        if not resolved.is_relative_to(root) or not resolved.exists():
            bad.append(target)
    return bad


def test_the_checked_files_exist():
    assert ROOT / "README.md" in DOCS and len(DOCS) >= 6


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md#part) [web](https://example.com) [anchor](#top)\n"
        "![img](gone.png) `[code](not-a-link.md)`\n\n```\n[x](fenced.md)\n```\n"
        "[ref]: missing/file.md\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up.md").write_text("[fine](../there.md) [outside](../../x.md)\n")
    assert relative_links(doc.read_text()) == ["there.md", "gone.png", "missing/file.md"]
    assert broken_links(doc, tmp_path) == ["gone.png", "missing/file.md"]
    assert broken_links(tmp_path / "sub" / "up.md", tmp_path) == ["../../x.md"]
