"""Wrappers forward the proposer contract generically: every member a wrapper does not define
is its base's (`spec_decode.ProposerWrapper`), never `ProposerBase`'s default."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import specjax
from specjax.proposers.lookup_graft import LookupGraftProposer
from specjax.serving.budget import BudgetedProposer
from specjax.spec_decode import ProposerBase, ProposerWrapper, contract_members


def project_proposer_classes():
    """Every ProposerBase subclass defined in specjax's modules."""
    for info in pkgutil.walk_packages(specjax.__path__, "specjax."):
        if info.name.startswith(("specjax.training", "specjax.convert")):
            continue
        importlib.import_module(info.name)
    seen, todo = set(), [ProposerBase]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen and sub.__module__.startswith("specjax."):
                seen.add(sub)
                todo.append(sub)
    return seen


def test_the_contract_lists_the_protocol_and_the_optional_parts():
    members = contract_members()
    for name in (
        "tree_size",
        "is_chain",
        "rule",
        "propose",
        "update",
        "init",
        "make_pools",
        "pools_of",
        "propose_may_be_skipped",
        "needs_prompt_features",
        "draft_scratch",
        "max_path_len",
        "argmax_nodes",
        "splits_draft_layers",
        "config",
    ):
        assert name in members
    assert "variant" not in members


def test_every_proposer_holding_a_base_is_a_wrapper_forwarding_what_it_does_not_define():
    classes = project_proposer_classes()
    wrappers = {c for c in classes if dataclasses.is_dataclass(c) and "base" in {f.name for f in dataclasses.fields(c)}}
    assert {BudgetedProposer, LookupGraftProposer} <= wrappers
    for cls in wrappers:
        assert issubclass(cls, ProposerWrapper), cls
        for name in contract_members():
            owner = next(k for k in cls.__mro__ if name in vars(k))
            assert owner is not ProposerBase, f"{cls.__name__}.{name} falls back to ProposerBase"


@dataclasses.dataclass(frozen=True)
class Distinct(ProposerBase):
    """A base whose every optional member differs from ProposerBase's default."""

    tree_size: int = 7
    is_chain: bool = False
    rule: str = "match"
    needs_prompt_features: bool = True
    resumes_from_prefix_pairs: bool = True
    feature_layers: tuple = (1, 2, 3)
    propose_may_be_skipped: bool = True
    plain_step_is_vanilla: bool = True
    defers_update: bool = True
    plain_decode: bool = True
    config: str = "a draft config"
    splits_draft_layers: bool = False
    draft_scratch: int = 11
    max_path_len: int = 4
    argmax_nodes: tuple = (2, 5)
    rules: tuple = ("match", "recursive")

    def make_pools(self, num_pages, page_size, dtype):
        return ("pools", num_pages)

    def pools_of(self, state):
        return ("pools of", state)


def test_a_wrapper_reads_its_base_for_what_it_does_not_define():
    base = Distinct()
    for wrapper in (BudgetedProposer(base, widths=(1, 3)), LookupGraftProposer(base)):
        own = {
            n
            for n in contract_members()
            if any(
                n in vars(k)
                for k in type(wrapper).__mro__
                if issubclass(k, ProposerWrapper) and k is not ProposerWrapper
            )
        }
        for name in set(contract_members()) - own - {"init", "propose", "update"}:
            got, want = getattr(wrapper, name), getattr(base, name)
            assert got == want, (type(wrapper).__name__, name, got, want)
        assert wrapper.make_pools(3, 16, None) == ("pools", 3)
        assert wrapper.pools_of("s") == ("pools of", "s")


def test_the_design_docs_contract_table_lists_every_member():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = text[text.index("## The proposer contract") : text.index("## Kernel dispatch")]
    rows = [
        line.split("|")[1].strip().strip("`").split("(")[0] for line in section.splitlines() if line.startswith("| `")
    ]
    assert sorted(rows) == sorted(contract_members())
