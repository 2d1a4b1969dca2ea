"""Method configs: options by name, refused where they do not fit, and the heads'
recommendations filling only what the user left unset."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specjax.method_configs import (CONFIGS, EagleConfig, LookaheadConfig, MedusaConfig,
                                    MethodError, PromptLookupConfig, RedrafterConfig,
                                    method_config, options_of)
from specjax.methods import as_flags, recommended


def test_options_by_name_build_the_method_config():
    assert method_config("eagle3", eagle_total_tokens=8) == EagleConfig(method="eagle3",
                                                                        eagle_total_tokens=8)
    assert method_config("pld", prompt_lookup_num_tokens=4) == PromptLookupConfig(4)
    assert method_config("lookahead") == LookaheadConfig()
    assert method_config("redrafter", redrafter_num_beams=2).redrafter_num_beams == 2
    assert dataclasses.is_dataclass(method_config("vanilla"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        MedusaConfig().heads = "x"


@pytest.mark.parametrize("method,options,words", [
    ("pld", {"min_draft_prob": 0.5}, ("`min_draft_prob` applies to", "medusa", "not pld")),
    ("eagle2", {"lookahead_accept_window": True}, ("applies to lookahead", "not eagle2")),
    ("eagle2", {"eagle_totl_tokens": 8}, ("unknown option `eagle_totl_tokens`", "eagle_depth")),
    ("nope", {}, ("unknown method 'nope'", "eagle2")),
])
def test_options_that_do_not_fit_are_refused_by_name(method, options, words):
    with pytest.raises(MethodError) as e:
        method_config(method, **options)
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(MethodError, match="EagleConfig.method"):
        EagleConfig(method="eagle4")


def test_errors_name_options_as_the_cli_flags():
    assert as_flags("`lookup_width` applies with `lookup_tokens`") == \
        "--lookup-width applies with --lookup-tokens"
    assert as_flags("no option here: it's plain") == "no option here: it's plain"


def test_every_option_is_declared_once_per_method():
    for method, cls in CONFIGS.items():
        names = options_of(cls)
        assert len(names) == len(set(names)) and "method" not in names, method


def test_recommendations_fill_only_what_is_unset(tmp_path):
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "specjax.json").write_text(json.dumps({"decoding_defaults": {
        "eagle2": {"eagle_total_tokens": 4, "eagle_depth": 2, "lookup_tokens": 5,
                   "min_matching_ngram_size": 2, "not_an_option": 1},
        "redrafter": {"redrafter_num_beams": 1}}}))
    got = recommended(EagleConfig(heads=str(heads), eagle_depth=3), target=None)
    assert (got.eagle_total_tokens, got.eagle_depth, got.eagle_top_k) == (4, 3, None)
    assert (got.lookup_tokens, got.min_matching_ngram_size) == (5, 2)
    off = recommended(EagleConfig(heads=str(heads), no_lookup=True), target=None)
    assert (off.eagle_total_tokens, off.lookup_tokens, off.min_matching_ngram_size) == (4, None,
                                                                                        None)
    mine = recommended(EagleConfig(heads=str(heads), lookup_tokens=7), target=None)
    assert (mine.lookup_tokens, mine.min_matching_ngram_size) == (7, 2)
    assert recommended(RedrafterConfig(heads=str(heads)), None).redrafter_num_beams == 1
    assert recommended(MedusaConfig(heads=str(heads)), None) == MedusaConfig(heads=str(heads))
    assert recommended(PromptLookupConfig(), None) == PromptLookupConfig()


def test_acceptance_defaults_to_recursive_where_it_applies():
    """Trees sample with `recursive` where they can be drawn for it (a floor cuts only top-k
    trees, so it does not matter): EAGLE-2/3 trees that fit its beams, static trees whose
    nodes' children skip no rank; else `match`. An unknown rule is refused."""
    from specjax.methods import _default_rule
    from specjax.proposers.eagle import EAGLE_DEFAULT_TREE
    from specjax.proposers.medusa import MC_SIM_7B_63

    small = dict(eagle_total_tokens=4, eagle_depth=2, eagle_top_k=2)
    assert _default_rule(EagleConfig(**small)) == "recursive"
    assert _default_rule(EagleConfig(method="eagle3", **small)) == "recursive"
    assert _default_rule(EagleConfig(**small, min_draft_prob=0.3)) == "recursive"
    assert _default_rule(EagleConfig()) == "match"  # 63/5/8: 62 nodes > 8 x 6
    eagle1 = EagleConfig(method="eagle")
    assert _default_rule(eagle1, EAGLE_DEFAULT_TREE) == "recursive"
    assert _default_rule(eagle1, [[0], [2]]) == "match"  # (2,) skips rank 1
    assert _default_rule(MedusaConfig(), MC_SIM_7B_63) == "recursive"
    assert _default_rule(MedusaConfig(), [[0], [0, 1]]) == "match"
    with pytest.raises(MethodError, match="`acceptance` is match, recursive or traversal"):
        EagleConfig(acceptance="greedy")
    with pytest.raises(MethodError, match="`acceptance` is match, recursive or traversal"):
        MedusaConfig(acceptance="typical")
