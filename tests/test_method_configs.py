"""Method configs: options by name, refused where they do not fit, and the heads'
recommendations filling only what the user left unset."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from specjax.method_configs import (
    CONFIGS,
    METHODS,
    EagleConfig,
    LookaheadConfig,
    MedusaConfig,
    MethodError,
    PromptLookupConfig,
    RedrafterConfig,
    method_config,
    options_of,
)
from specjax.methods import as_flags, recommended


def test_options_by_name_build_the_method_config():
    assert method_config("eagle3", eagle_total_tokens=8) == EagleConfig(method="eagle3", eagle_total_tokens=8)
    assert method_config("pld", prompt_lookup_num_tokens=4) == PromptLookupConfig(prompt_lookup_num_tokens=4)
    assert method_config("lookahead") == LookaheadConfig()
    assert method_config("redrafter", redrafter_num_beams=2).redrafter_num_beams == 2
    assert dataclasses.is_dataclass(method_config("vanilla"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        MedusaConfig().heads = "x"


@pytest.mark.parametrize(
    "method,options,words",
    [
        ("pld", {"min_draft_prob": 0.5}, ("`min_draft_prob` applies to", "medusa", "not pld")),
        ("eagle2", {"lookahead_accept_window": True}, ("applies to lookahead", "not eagle2")),
        ("eagle2", {"eagle_totl_tokens": 8}, ("unknown option `eagle_totl_tokens`", "eagle_depth")),
        ("nope", {}, ("unknown method 'nope'", "eagle2")),
    ],
)
def test_options_that_do_not_fit_are_refused_by_name(method, options, words):
    with pytest.raises(MethodError) as e:
        method_config(method, **options)
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(MethodError, match="EagleConfig.method"):
        EagleConfig(method="eagle4")


def test_errors_name_options_as_the_cli_flags():
    assert as_flags("`lookup_width` applies with `lookup_tokens`") == "--lookup-width applies with --lookup-tokens"
    assert as_flags("no option here: it's plain") == "no option here: it's plain"


def test_every_option_is_declared_once_per_method():
    for method, cls in CONFIGS.items():
        names = options_of(cls)
        assert len(names) == len(set(names)) and "method" not in names, method


def test_recommendations_fill_only_what_is_unset(tmp_path):
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "specjax.json").write_text(
        json.dumps(
            {
                "decoding_defaults": {
                    "eagle2": {
                        "eagle_total_tokens": 4,
                        "eagle_depth": 2,
                        "lookup_tokens": 5,
                        "min_matching_ngram_size": 2,
                        "not_an_option": 1,
                    },
                    "redrafter": {"redrafter_num_beams": 1},
                }
            }
        )
    )
    got = recommended(EagleConfig(heads=str(heads), eagle_depth=3), target=None)
    assert (got.eagle_total_tokens, got.eagle_depth, got.eagle_top_k) == (4, 3, None)
    assert (got.lookup_tokens, got.min_matching_ngram_size) == (5, 2)
    off = recommended(EagleConfig(heads=str(heads), no_lookup=True), target=None)
    assert (off.eagle_total_tokens, off.lookup_tokens, off.min_matching_ngram_size) == (4, None, None)
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


def test_eagle_is_an_alias_of_eagle1(tmp_path):
    from specjax.methods import heads_decoding_defaults

    assert method_config("eagle") == EagleConfig(method="eagle1") == EagleConfig(method="eagle")
    assert "eagle" not in METHODS and "eagle1" in METHODS
    with pytest.raises(MethodError, match="EagleConfig.method is eagle1, eagle2 or eagle3, not 'eagle4'"):
        EagleConfig(method="eagle4")
    # Heads written before the rename keep their EAGLE-1 recommendation under "eagle".
    (tmp_path / "specjax.json").write_text(json.dumps({"decoding_defaults": {"eagle": {"eagle_draft_vocab": 7}}}))
    want = {"eagle_draft_vocab": 7} if jax.default_backend() == "cpu" else {}  # CPU-measured
    assert heads_decoding_defaults(tmp_path, "eagle1") == want


def test_the_docs_options_table_is_the_generated_one():
    from pathlib import Path

    from specjax.method_configs import options_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    start = text.index("<!-- options table: generated by specjax.method_configs.options_table() -->\n")
    table = text[text.index("\n", start) + 1 : text.index("<!-- end of the options table -->")]
    assert table == options_table(), (
        "docs/methods.md's options table differs from the configs: paste `specjax.method_configs.options_table()` in"
    )


def test_every_option_is_one_flag_and_a_flag_left_out_is_not_given():
    import argparse

    from specjax.method_configs import add_option_flags, flag_of, given_options

    parser = argparse.ArgumentParser()
    add_option_flags(parser)
    assert given_options(parser.parse_args([])) == {}
    names = {n for cls in CONFIGS.values() for n in options_of(cls)}
    flags = {a.dest: a.option_strings for a in parser._actions if a.dest in names}
    assert set(flags) == names and all(flags[n] == [flag_of(n)] for n in names)
    argv = [
        "--eagle-depth",
        "3",
        "--no-lookup",
        "--redrafter-no-greedy-search",
        "--lookahead",
        "4,3,2",
        "--redrafter-warp-top-k",
        "0",
        "--min-draft-prob",
        "0.25",
        "--medusa-choices",
        "[[0], [1]]",
    ]
    given = given_options(parser.parse_args(argv))
    assert given == {
        "eagle_depth": 3,
        "no_lookup": True,
        "redrafter_greedy_search": False,
        "lookahead": "4,3,2",
        "redrafter_warp_top_k": "0",
        "min_draft_prob": 0.25,
        "medusa_choices": "[[0], [1]]",
    }
    assert method_config("lookahead", lookahead=given["lookahead"]).lookahead == (4, 3, 2)
    assert method_config("redrafter", redrafter_warp_top_k="0").redrafter_warp_top_k is None
    assert method_config("medusa", medusa_choices=given["medusa_choices"]).medusa_choices == [[0], [1]]


@pytest.mark.parametrize(
    "method,options,message",
    [
        ("eagle2", {"eagle_depth": "3"}, "`eagle_depth` must be an integer, got '3'"),
        ("eagle2", {"eagle_depth": 0}, "`eagle_depth` must be >= 1, got 0"),
        ("eagle2", {"min_draft_prob": 1.5}, "`min_draft_prob` must be in [0, 1], got 1.5"),
        ("eagle2", {"min_draft_prob": float("nan")}, "`min_draft_prob` must be a number, got nan"),
        ("eagle2", {"no_lookup": 1}, "`no_lookup` is true or false, got 1"),
        ("medusa", {"acceptance": "typical"}, "`acceptance` is match, recursive or traversal"),
        ("pld", {"min_matching_ngram_size": 4}, "1 <= `min_matching_ngram_size` <= `max_matching_ngram_size`"),
        ("lookahead", {"lookahead": "7,1,7"}, "`lookahead` n-gram size N must be >= 2, got 1"),
        ("lookahead", {"lookahead": "7,5"}, "`lookahead` takes W,N,G"),
        ("eagle", {"eagle_choices": "[[0],"}, "`eagle_choices` is not valid JSON"),
        ("draft", {"draft_layers": 2, "draft_model": "x"}, "either a draft model or draft layers"),
    ],
)
def test_option_errors_come_from_the_declarations(method, options, message):
    with pytest.raises(MethodError) as e:
        method_config(method, **options)
    assert message in str(e.value)
