"""One frozen config per decoding method: each option declared once, as a field with its metadata.

A field's `option(...)` metadata (help, the default as it reads when the field's default is
None, bounds, choices, how a command-line string parses, the TensorRT-LLM or Hugging Face name)
is where everything else comes from: the checks and their errors here, the `specjax generate` /
`serve` flags and their `--help` (`add_option_flags`), and the options table of docs/methods.md
(`options_table`, checked by tests/test_method_configs.py). Field names are the options' names
everywhere: `make_proposer`'s keywords, `specjax bench`'s `METHOD:key=value` and the flags
(`eagle_total_tokens` is `--eagle-total-tokens`). A head method's option left None takes the head
checkpoint's recommendation (`methods.recommended`), else the default the table names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Callable, ClassVar

from specjax.draft_tree import TREE_RULES


class MethodError(ValueError):
    """Unknown method or options that do not fit it. Messages name options in backquotes
    (`lookup_tokens`); the CLI shows them as its flags (`--lookup-tokens`)."""


@dataclass(frozen=True)
class Option:
    """What a method option is, beside its field's type and default."""

    help: str
    default_text: str | None = None  # the default in words, where the field's is None or a sentinel
    peer: str = ""  # its name in TensorRT-LLM or Hugging Face, where they have one
    low: float | None = None  # inclusive bounds of a number
    high: float | None = None
    choices: tuple = ()
    parse: Callable[[str], object] | None = None  # a command-line string to the value
    metavar: str | None = None
    flag: str | None = None  # the command-line flag where it is not --name (a negated bool)


def option(default, help: str, **meta) -> dataclasses.Field:
    """A method config field and its `Option` metadata."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **meta)})


def parse_lookahead(text) -> tuple[int, int, int]:
    """(W, N, G) of "W,N,G" (or a sequence of three), checked: W >= 1, N >= 2, G >= 1."""
    try:
        w, n, g = (int(x) for x in (text.split(",") if isinstance(text, str) else text))
    except (TypeError, ValueError):
        raise MethodError(f"`lookahead` takes W,N,G (three integers, e.g. 7,5,7), got '{text}'") from None
    for name, value, low in (("window size W", w, 1), ("n-gram size N", n, 2), ("verification set size G", g, 1)):
        if value < low:
            raise MethodError(f"`lookahead` {name} must be >= {low}, got {value}")
    return w, n, g


def _parse_paths(text, name: str):
    """A tree given as JSON paths of top-k ranks, e.g. '[[0], [0, 0], [1]]'."""
    try:
        paths = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        raise MethodError(f"`{name}` is not valid JSON (e.g. '[[0], [0, 0], [1]]')") from None
    if not (
        isinstance(paths, (list, tuple))
        and paths
        and all(isinstance(c, (list, tuple)) and all(isinstance(r, int) for r in c) for c in paths)
    ):
        raise MethodError(f"`{name}` must be a JSON list of lists of integer ranks")
    return [list(c) for c in paths]


def parse_medusa_choices(text):
    """A named tree (mc_sim_7b_63, ...) or JSON paths of top-k ranks."""
    from specjax.proposers.medusa import MEDUSA_TREES

    if isinstance(text, str) and text.strip().lower() in MEDUSA_TREES:
        return text.strip().lower()
    if isinstance(text, str) and not text.strip().startswith("["):
        raise MethodError(
            f"unknown medusa_choices '{text}' (a named tree: {', '.join(MEDUSA_TREES)}, or a list of paths)"
        )
    return _parse_paths(text, "medusa_choices")


def parse_eagle_choices(text):
    return _parse_paths(text, "eagle_choices")


def _zero_is_none(text):
    """An integer where 0 (or None) means none."""
    try:
        return int(text) or None
    except (TypeError, ValueError):
        raise MethodError(f"`redrafter_warp_top_k` must be an integer, got {text!r}") from None


@dataclass(frozen=True, kw_only=True)
class _Options:
    """Checks every option of a config against its metadata (type, bounds, choices), then the
    class's own `check` for what ties options together."""

    title: ClassVar[str] = ""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in option_fields(type(self)):
            meta, value = f.metadata["option"], getattr(self, f.name)
            if meta.parse is not None and value is not None and value != f.default:
                value = meta.parse(value)
                object.__setattr__(self, f.name, value)
            if value is not None:
                _check_value(f.name, value, hints[f.name], meta)
        self.check()

    def check(self) -> None:
        """Checks between options (none by default)."""


def _check_value(name: str, value, hint, meta: Option) -> None:
    kinds = set(typing.get_args(hint) or (hint,)) - {type(None)}
    if kinds == {bool}:
        if not isinstance(value, bool):
            raise MethodError(f"`{name}` is true or false, got {value!r}")
    elif kinds & {int, float}:
        number = (int, float) if float in kinds else (int,)
        if isinstance(value, bool) or not isinstance(value, number) or (isinstance(value, float) and math.isnan(value)):
            kind = "a number" if float in kinds else "an integer"
            raise MethodError(f"`{name}` must be {kind}, got {value!r}")
        if meta.low is not None and meta.high is not None and not meta.low <= value <= meta.high:
            raise MethodError(f"`{name}` must be in [{meta.low:g}, {meta.high:g}], got {value}")
        if meta.low is not None and value < meta.low:
            raise MethodError(f"`{name}` must be >= {meta.low:g}, got {value}")
    if meta.choices and value not in meta.choices:
        names = f"{', '.join(meta.choices[:-1])} or {meta.choices[-1]}"
        raise MethodError(f"`{name}` is {names}, not {value!r}")


@dataclass(frozen=True, kw_only=True)
class VanillaConfig(_Options):
    """Plain decoding: one token per target pass."""

    method: ClassVar[str] = "vanilla"


@dataclass(frozen=True, kw_only=True)
class DraftModelConfig(_Options):
    """Draft-Target-Model: `draft_model` (any model with the target's vocabulary), else a
    self-draft of the target's first `draft_layers` layers."""

    method: ClassVar[str] = "draft"
    title: ClassVar[str] = "Draft-Target-Model"
    max_draft_len: int = option(4, "tokens drafted per step", low=1, peer="max_draft_len (TensorRT-LLM)")
    use_logits: bool = option(False, "accept by min(1, p/q) with the draft's probabilities (else token match)")
    draft_layers: int | None = option(
        None, "self-draft from the target's first N layers", default_text="8", metavar="N"
    )
    draft_model: str | None = option(
        None,
        "a draft model (name, dir or .gguf)",
        default_text="a self-draft",
        peer="speculative_model_dir (TensorRT-LLM)",
    )

    def check(self):
        if self.draft_model is not None and self.draft_layers is not None:
            raise MethodError("give either a draft model or draft layers, not both")


@dataclass(frozen=True, kw_only=True)
class _NgramMatch(_Options):
    """The n-gram search of prompt lookup, alone (pld) or grafted onto a head method's tree."""

    title: ClassVar[str] = "n-gram matching of prompt lookup, alone or grafted"
    max_matching_ngram_size: int = option(
        3, "longest n-gram to match", low=1, peer="max_matching_ngram_size (HF, TensorRT-LLM)"
    )
    min_matching_ngram_size: int | None = option(
        None,
        "shortest n-gram to match (2 suits CPUs, where verifying costs more)",
        low=1,
        default_text="1, or the heads' decoding_defaults for a graft",
        peer="prompt_lookup_min (vLLM)",
    )

    def check(self):
        low = 1 if self.min_matching_ngram_size is None else self.min_matching_ngram_size
        if low > self.max_matching_ngram_size:
            raise MethodError(
                "n-gram sizes must satisfy 1 <= `min_matching_ngram_size` <= "
                f"`max_matching_ngram_size`, got {low} and {self.max_matching_ngram_size}"
            )


@dataclass(frozen=True, kw_only=True)
class PromptLookupConfig(_NgramMatch):
    """Prompt lookup: up to `prompt_lookup_num_tokens` tokens that followed the longest earlier
    match of the last n tokens (min <= n <= max)."""

    method: ClassVar[str] = "pld"
    title: ClassVar[str] = "Prompt-Lookup"
    prompt_lookup_num_tokens: int = option(10, "tokens drafted per step", low=1, peer="prompt_lookup_num_tokens (HF)")


@dataclass(frozen=True, kw_only=True)
class SuffixConfig(_Options):
    """Suffix decoding: a tree of what followed earlier occurrences of the longest match of the
    text's last tokens, counted (`specjax.proposers.suffix`)."""

    method: ClassVar[str] = "suffix"
    title: ClassVar[str] = "Suffix decoding (the request's tokens and a cache of earlier outputs)"
    suffix_max_draft_tokens: int = option(
        8, "tree nodes drafted per step at most", low=1, peer="num_speculative_tokens (vLLM)"
    )
    suffix_decoding_max_tree_depth: int = option(
        24, "match length plus draft depth at most", low=1, peer="suffix_decoding_max_tree_depth (vLLM)"
    )
    suffix_decoding_max_spec_factor: float = option(
        1.0, "draft up to factor x match length (+ offset) tokens", low=0, peer="suffix_decoding_max_spec_factor (vLLM)"
    )
    suffix_decoding_max_spec_offset: float = option(
        0.0, "tokens added to that bound", peer="max_spec_offset (ArcticInference)"
    )
    suffix_decoding_min_token_prob: float = option(
        0.1,
        "draft only continuations of estimated probability (count share) at least this",
        low=0,
        high=1,
        peer="suffix_decoding_min_token_prob (vLLM)",
    )
    suffix_max_match: int = option(8, "longest match of the text's last tokens looked for", low=1)
    suffix_decoding_max_cached_tokens: int = option(
        1 << 18,
        "earlier outputs kept for every request to search, in tokens (oldest evicted; 0: none)",
        low=0,
        peer="suffix_decoding_max_cached_requests (vLLM, in requests)",
    )


@dataclass(frozen=True, kw_only=True)
class LookaheadConfig(_Options):
    """Lookahead: TensorRT-LLM's (W, N, G) = (max_window_size, max_ngram_size,
    max_verification_set_size)."""

    method: ClassVar[str] = "lookahead"
    title: ClassVar[str] = "Lookahead: Jacobi window + n-gram pool"
    lookahead: tuple = option(
        (7, 5, 7),
        "max_window_size, max_ngram_size, max_verification_set_size",
        default_text="7,5,7",
        parse=parse_lookahead,
        metavar="W,N,G",
        peer="(max_window_size, max_ngram_size, max_verification_set_size) (TensorRT-LLM)",
    )
    lookahead_accept_window: bool = option(
        False,
        "also accept the window's own chains from the "
        "pending token (Jacobi decoding's acceptance; off "
        "in the references)",
    )


@dataclass(frozen=True, kw_only=True)
class HeadMethod(_NgramMatch):
    """What every trained-head method shares: the head checkpoint and the prompt-lookup graft."""

    title: ClassVar[str] = "trained draft heads"
    heads: str | None = option(
        None, "draft-head checkpoint (specjax format)", default_text="the embedded model's shipped heads"
    )
    lookup_tokens: int | None = option(
        None,
        "also draft the prompt-lookup continuation (up to N tokens, n-grams of "
        "min/max_matching_ngram_size) grafted onto the tree, verified in the same pass",
        default_text="the heads' decoding_defaults",
        low=1,
        metavar="N",
    )
    lookup_width: int | None = option(
        None,
        "with lookup_tokens: verify a step with a continuation at most W wide, the tree's "
        "last (lowest-ranked) nodes giving way to its tokens (greedy steps; a tree drawn for "
        "sampling is verified whole)",
        default_text="the heads' decoding_defaults",
        low=1,
        metavar="W",
    )
    lookup_method: str | None = option(
        None,
        "what drafts the grafted chain: 'pld' (the continuation of the longest earlier n-gram "
        "match) or 'suffix' (the most frequent continuation of the text's last tokens, "
        "suffix decoding's counts, up to lookup_tokens)",
        default_text="the heads' decoding_defaults, else pld",
        choices=("pld", "suffix"),
    )
    no_lookup: bool = option(False, "no prompt-lookup graft, even where the heads recommend one")


@dataclass(frozen=True, kw_only=True)
class _TopKTree(HeadMethod):
    """What Medusa's and EAGLE's trees of top-k children share: the confidence floor and the
    sampling rule."""

    title: ClassVar[str] = "trees of top-k children"
    min_draft_prob: float | None = option(
        None,
        "verify only drafted nodes whose cumulative draft probability is at least this "
        "(0: all); steps with unlikely drafts run narrower, down to a plain decode step. "
        "Top-k trees only (greedy, or sampling with acceptance match)",
        default_text="the heads' decoding_defaults, else 0",
        low=0,
        high=1,
    )
    acceptance: str | None = option(
        None,
        "the rule when sampling: recursive (children drawn without replacement from the "
        "draft, recursive rejection sampling), traversal (the same trees verified leaves "
        "first with path weights; trees of fixed shape) or match (the target's sample must "
        "equal a top-k child)",
        default_text="recursive where the tree allows, else match",
        choices=TREE_RULES,
    )


@dataclass(frozen=True, kw_only=True)
class MedusaConfig(_TopKTree):
    """Medusa heads over `medusa_choices` (paths of top-k ranks, or a named tree)."""

    method: ClassVar[str] = "medusa"
    heads_kind: ClassVar[str] = "medusa"  # the head checkpoints it reads (`specjax.heads`)
    title: ClassVar[str] = "Medusa"
    medusa_choices: object = option(
        None,
        "tree as JSON paths of top-k ranks, e.g. '[[0], [0, 0], [1]]', or mc_sim_7b_63 "
        "(Medusa's 63-node tree); leaf paths alone are completed",
        default_text="the heads' decoding_defaults, else mc_sim_7b_63",
        parse=parse_medusa_choices,
        peer="medusa_choices (TensorRT-LLM)",
    )
    posterior_threshold: float | None = option(
        None,
        "typical acceptance (LOSSY: output no longer follows the model's distribution; "
        "Medusa uses 0.09); sampling only",
        default_text="off",
        low=0,
        peer="posterior_threshold (Medusa)",
    )
    posterior_alpha: float = option(0.3, "typical acceptance's entropy weight", low=0, peer="posterior_alpha (Medusa)")


@dataclass(frozen=True, kw_only=True)
class EagleConfig(_TopKTree):
    """EAGLE heads: `method` eagle1 (EAGLE-1, static `eagle_choices` tree), eagle2 (dynamic tree)
    or eagle3 (the same over EAGLE-3 heads). `eagle`, TensorRT-LLM's name, is EAGLE-1."""

    title: ClassVar[str] = "EAGLE-1 static tree; EAGLE-2 and EAGLE-3 dynamic trees"
    method: str = "eagle2"
    eagle_choices: object = option(
        None,
        "EAGLE-1 tree as JSON paths of top-k ranks",
        default_text="SafeAILab's 25-node tree",
        parse=parse_eagle_choices,
        peer="eagle_choices (TensorRT-LLM)",
    )
    eagle_total_tokens: int | None = option(
        None,
        "EAGLE-2/3: tree nodes verified per step, root included",
        default_text="63",
        low=1,
        peer="total_token (EAGLE)",
    )
    eagle_depth: int | None = option(
        None,
        "EAGLE-2/3: expansion passes after the first, so paths of up to depth + 1 drafted tokens",
        default_text="5",
        low=1,
        peer="depth (EAGLE)",
    )
    eagle_top_k: int | None = option(
        None,
        "EAGLE-2/3: children per expanded node and nodes expanded per depth",
        default_text="8",
        low=1,
        peer="top_k (EAGLE)",
    )
    eagle_draft_vocab: int | None = option(
        None,
        "EAGLE-1/2: draft only the N most frequent tokens (heads trained by specjax store the order)",
        default_text="the heads' decoding_defaults, else all the heads store",
        low=1,
        metavar="N",
    )

    @property
    def heads_kind(self) -> str:
        """EAGLE-1 and EAGLE-2 read EAGLE heads; EAGLE-3 its own."""
        return "eagle3" if self.method == "eagle3" else "eagle"

    def check(self):
        object.__setattr__(self, "method", ALIASES.get(self.method, self.method))
        if self.method not in ("eagle1", "eagle2", "eagle3"):
            raise MethodError(f"EagleConfig.method is eagle1, eagle2 or eagle3, not {self.method!r}")
        super().check()


@dataclass(frozen=True, kw_only=True)
class RedrafterConfig(HeadMethod):
    """ReDrafter: beams drafted by a recurrent head, beam search over its best tokens."""

    method: ClassVar[str] = "redrafter"
    heads_kind: ClassVar[str] = "redrafter"
    title: ClassVar[str] = "ReDrafter: recurrent drafter + beam search"
    redrafter_num_beams: int | None = option(
        None,
        "beams drafted per step",
        default_text="the heads' recommendation, else 5",
        low=1,
        peer="redrafter_num_beams (TensorRT-LLM)",
    )
    redrafter_draft_len_per_beam: int | None = option(
        None,
        "tokens each beam drafts",
        default_text="the heads' recommendation, else 5",
        low=1,
        peer="redrafter_draft_len_per_beam (TensorRT-LLM)",
    )
    redrafter_greedy_search: bool = option(
        True,
        "beam search (off: sample the beams at the request's temperature)",
        flag="redrafter_no_greedy_search",
        peer="redrafter_greedy_search (TensorRT-LLM)",
    )
    redrafter_warp_top_k: int | None = option(
        50,
        "beam search keeps the drafter's K best tokens per step (None, or 0 on the command line: all)",
        parse=_zero_is_none,
        low=1,
    )


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(HeadMethod):
    """DFlash: a block drafter drafts every position of a block in one forward, as a chain or
    (`dflash_tree_budget`) a best-first tree of its per-position distributions (DDTree)."""

    method: ClassVar[str] = "dflash"
    heads_kind: ClassVar[str] = "dflash"
    title: ClassVar[str] = "DFlash block drafter: chain or DDTree tree"
    dflash_block_size: int | None = option(
        None,
        "block drafted per step: the pending token and N - 1 drafted positions",
        default_text="the checkpoint's block_size",
        low=2,
        metavar="N",
        peer="block_size (DFlash)",
    )
    dflash_tree_budget: int | None = option(
        None,
        "verify a best-first tree of N nodes (root included) built from the block's "
        "per-position distributions instead of a chain",
        default_text="off (a chain)",
        low=2,
        metavar="N",
        peer="node budget (DDTree)",
    )
    dflash_top_k: int = option(8, "tree: candidate tokens per position", low=1)
    dflash_acceptance: str | None = option(
        None,
        "the rule when sampling: residual (chain drafts drawn from the drafter, accepted by "
        "min(1, p/q)) or match (argmax drafts; the target's sample must equal one)",
        default_text="residual for chains, match for trees",
        choices=("residual", "match"),
    )

    def check(self):
        super().check()
        if self.dflash_tree_budget is not None and self.dflash_acceptance == "residual":
            raise MethodError("`dflash_tree_budget` trees verify with `dflash_acceptance` match, not residual")


CONFIGS = {
    "vanilla": VanillaConfig,
    "draft": DraftModelConfig,
    "pld": PromptLookupConfig,
    "suffix": SuffixConfig,
    "medusa": MedusaConfig,
    "eagle1": EagleConfig,
    "eagle2": EagleConfig,
    "eagle3": EagleConfig,
    "redrafter": RedrafterConfig,
    "lookahead": LookaheadConfig,
    "dflash": DFlashConfig,
}
METHODS = tuple(CONFIGS)
# Other names a method answers to: `eagle` is EAGLE-1 in TensorRT-LLM and in earlier specjax.
ALIASES = {"eagle": "eagle1"}


def canonical_method(method: str) -> str:
    """The method's own name (`eagle1` for its alias `eagle`); unknown names pass through."""
    return ALIASES.get(method, method)


HeadMethodConfig = MedusaConfig | EagleConfig | RedrafterConfig | DFlashConfig
MethodConfig = VanillaConfig | DraftModelConfig | PromptLookupConfig | SuffixConfig | LookaheadConfig | HeadMethodConfig


def option_fields(cls) -> tuple[dataclasses.Field, ...]:
    """The option fields of a config class (every field but `method`)."""
    return tuple(f for f in dataclasses.fields(cls) if "option" in f.metadata)


def options_of(cls) -> tuple[str, ...]:
    """The option names a config class takes."""
    return tuple(f.name for f in option_fields(cls))


def method_config(method: str, **options) -> MethodConfig:
    """The config of `method` with `options` (an option of another method is refused, naming
    the methods it belongs to). An alias (`eagle`) gives its method's config."""
    method = canonical_method(method)
    if method not in CONFIGS:
        raise MethodError(f"unknown method '{method}' (available: {', '.join(METHODS)})")
    cls = CONFIGS[method]
    own = options_of(cls)
    for key in options:
        if key not in own:
            users = [m for m, c in CONFIGS.items() if key in options_of(c)]
            if not users:
                raise MethodError(f"unknown option `{key}` (options of {method}: {', '.join(own) or 'none'})")
            raise MethodError(f"`{key}` applies to {', '.join(users)}, not {method}")
    return cls(method=method, **options) if cls is EagleConfig else cls(**options)


# --- generated from the fields: the command line's flags and the docs' table ---


def _declared_options() -> list[tuple[dataclasses.Field, type, list[str]]]:
    """Every option once, in declaration order: (field, the class that declares it, the methods
    that take it)."""
    out, seen = [], set()
    for cls in dict.fromkeys(CONFIGS.values()):
        for owner in reversed(cls.__mro__):
            for f in option_fields(cls) if dataclasses.is_dataclass(owner) else ():
                if f.name in seen or f.name not in owner.__dict__.get("__annotations__", {}):
                    continue
                seen.add(f.name)
                out.append((f, owner, [m for m, c in CONFIGS.items() if f.name in options_of(c)]))
    return out


def as_flags(message: str) -> str:
    """A MethodError's message with its `option` names as the command line's flags."""
    return re.sub(r"`([a-z0-9_]+)`", lambda m: flag_of(m.group(1)), message)


def flag_of(name: str) -> str:
    """The command-line flag of option `name` (an unknown name: --name with dashes)."""
    for f, _, _ in _declared_options():
        if f.name == name:
            return "--" + (f.metadata["option"].flag or name).replace("_", "-")
    return "--" + name.replace("_", "-")


def _default_words(f: dataclasses.Field) -> str:
    meta = f.metadata["option"]
    if meta.default_text is not None:
        return meta.default_text
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if isinstance(f.default, tuple):
        return ",".join(map(str, f.default))
    return "none" if f.default is None else str(f.default)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option, grouped by the class that declares it. A flag left out is absent
    from the parsed namespace (`given_options`), so a config's defaults and the heads'
    recommendations apply."""
    hints = {}
    groups = {}
    for f, owner, methods in _declared_options():
        hints.setdefault(owner, typing.get_type_hints(owner))
        if owner not in groups:
            groups[owner] = parser.add_argument_group(f"{owner.title} ({', '.join(methods)})")
        meta, kinds = (
            f.metadata["option"],
            set(typing.get_args(hints[owner][f.name]) or (hints[owner][f.name],)) - {type(None)},
        )
        text = f"{meta.help} (default: {_default_words(f)})".replace("%", "%%")
        kw = dict(default=argparse.SUPPRESS, help=text, dest=f.name)
        if kinds == {bool}:
            kw.update(action="store_const", const=not f.default)
        else:
            kw.update(
                metavar=meta.metavar or f.name.upper().split("_")[-1],
                type={int: int, float: float}.get(next(iter(kinds))) if meta.parse is None else str,
            )
            if meta.choices:
                kw.update(choices=meta.choices, metavar=None)
        groups[owner].add_argument(flag_of(f.name), **kw)


def given_options(args: argparse.Namespace) -> dict:
    """The options given on a command line parsed with `add_option_flags`."""
    names = {f.name for f, _, _ in _declared_options()}
    return {k: v for k, v in vars(args).items() if k in names}


def options_table() -> str:
    """The options as docs/methods.md's table (markdown)."""
    rows = [
        "| option | flag | methods | default | TensorRT-LLM / HF / paper name | what |",
        "|---|---|---|---|---|---|",
    ]
    for f, _, methods in _declared_options():
        meta = f.metadata["option"]
        cells = [
            f"`{f.name}`",
            f"`{flag_of(f.name)}`",
            ", ".join(methods),
            _default_words(f),
            meta.peer or "",
            meta.help,
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
