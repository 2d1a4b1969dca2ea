"""One frozen config per decoding method: its options with their defaults.

Field names are the options' names everywhere: `make_proposer`'s keywords, `specjax bench`'s
`METHOD:key=value` and the CLI's flags (`eagle_total_tokens` is `--eagle-total-tokens`), which
follow TensorRT-LLM (`max_draft_len`, `medusa_choices`, `eagle_choices`, `redrafter_num_beams`,
`max_window_size`-style W,N,G for Lookahead) and Hugging Face (`prompt_lookup_num_tokens`,
`max_matching_ngram_size`). A head method's option left None takes the head checkpoint's
recommendation (`methods.recommended`), else the method's own default (docs/methods.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from specjax.draft_tree import TREE_RULES


class MethodError(ValueError):
    """Unknown method or options that do not fit it. Messages name options in backquotes
    (`lookup_tokens`); the CLI shows them as its flags (`--lookup-tokens`)."""


@dataclass(frozen=True)
class VanillaConfig:
    """Plain decoding: one token per target pass."""

    method: ClassVar[str] = "vanilla"


@dataclass(frozen=True)
class DraftModelConfig:
    """Draft-Target-Model: `draft_model` (any model with the target's vocabulary), else a
    self-draft of the target's first `draft_layers` layers (default 8), drafting
    `max_draft_len` tokens; `use_logits` accepts by min(1, p/q) instead of token match."""

    method: ClassVar[str] = "draft"
    max_draft_len: int = 4
    use_logits: bool = False
    draft_layers: int | None = None
    draft_model: str | None = None


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup: up to `prompt_lookup_num_tokens` tokens that followed the longest earlier
    match of the last n tokens (min <= n <= max)."""

    method: ClassVar[str] = "pld"
    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 3
    min_matching_ngram_size: int = 1


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead: TensorRT-LLM's (W, N, G) = (max_window_size, max_ngram_size,
    max_verification_set_size); `lookahead_accept_window` also accepts the window's own chains
    from the root (Jacobi decoding's acceptance)."""

    method: ClassVar[str] = "lookahead"
    lookahead: tuple = (7, 5, 7)
    lookahead_accept_window: bool = False


def check_acceptance(rule: str | None) -> None:
    """Refuse an `acceptance` rule that is not one of the lossless tree rules."""
    if rule is not None and rule not in TREE_RULES:
        names = f"{', '.join(TREE_RULES[:-1])} or {TREE_RULES[-1]}"
        raise MethodError(f"`acceptance` is {names}, not {rule!r}")


@dataclass(frozen=True)
class _HeadMethod:
    """What every trained-head method shares: the head checkpoint (`heads`; None: the shipped
    heads of an embedded model) and the prompt-lookup graft (`lookup_tokens` tokens of n-grams
    of min/max_matching_ngram_size verified in the same pass, the step at most `lookup_width`
    wide). `no_lookup` declines a graft the heads recommend."""

    heads: str | None = None
    lookup_tokens: int | None = None
    lookup_width: int | None = None
    max_matching_ngram_size: int = 3
    min_matching_ngram_size: int | None = None
    no_lookup: bool = False


@dataclass(frozen=True)
class MedusaConfig(_HeadMethod):
    """Medusa heads over `medusa_choices` (paths of top-k ranks, or a named tree; default
    mc_sim_7b_63 cut to the heads there are). `posterior_threshold` turns on typical acceptance
    (lossy, sampling only); `min_draft_prob` verifies only nodes that likely (top-k trees).
    `acceptance` is the lossless rule when sampling: `match` (top-k trees) or `recursive` (each
    head's ranks drawn without replacement, recursive rejection sampling; the default where
    no node's children skip a rank)."""

    method: ClassVar[str] = "medusa"
    medusa_choices: object = None
    posterior_threshold: float | None = None
    posterior_alpha: float = 0.3
    min_draft_prob: float | None = None
    acceptance: str | None = None  # None: recursive where the tree can be drawn, else match

    def __post_init__(self):
        check_acceptance(self.acceptance)


@dataclass(frozen=True)
class EagleConfig(_HeadMethod):
    """EAGLE heads: `method` eagle (EAGLE-1, static `eagle_choices` tree), eagle2 (dynamic tree
    of `eagle_total_tokens` nodes, `eagle_depth`, `eagle_top_k`; default 63/5/8) or eagle3
    (the same over EAGLE-3 heads). `eagle_draft_vocab` drafts from the N most frequent tokens
    (EAGLE-1/2); `min_draft_prob` verifies only nodes that likely (top-k trees). `acceptance`
    is the rule when sampling: `match` (top-k trees) or `recursive` (children drawn without
    replacement from the draft, recursive rejection sampling, which accepted more and ran
    faster in every sampled benchmark; the default where the tree can be drawn for it). Greedy
    decoding is the same under both."""

    method: str = "eagle2"
    eagle_choices: object = None
    eagle_total_tokens: int | None = None
    eagle_depth: int | None = None
    eagle_top_k: int | None = None
    eagle_draft_vocab: int | None = None
    min_draft_prob: float | None = None
    acceptance: str | None = None  # None: recursive where the tree can be drawn, else match

    def __post_init__(self):
        if self.method not in ("eagle", "eagle2", "eagle3"):
            raise MethodError(f"EagleConfig.method is eagle, eagle2 or eagle3, not {self.method!r}")
        check_acceptance(self.acceptance)


@dataclass(frozen=True)
class RedrafterConfig(_HeadMethod):
    """ReDrafter: `redrafter_num_beams` beams of `redrafter_draft_len_per_beam` tokens (default
    5 and 5), beam search over the drafter's `redrafter_warp_top_k` best tokens (None: all), or
    sampled beams without `redrafter_greedy_search`."""

    method: ClassVar[str] = "redrafter"
    redrafter_num_beams: int | None = None
    redrafter_draft_len_per_beam: int | None = None
    redrafter_greedy_search: bool = True
    redrafter_warp_top_k: int | None = 50


CONFIGS = {"vanilla": VanillaConfig, "draft": DraftModelConfig, "pld": PromptLookupConfig,
           "medusa": MedusaConfig, "eagle": EagleConfig, "eagle2": EagleConfig,
           "eagle3": EagleConfig, "redrafter": RedrafterConfig, "lookahead": LookaheadConfig}
METHODS = tuple(CONFIGS)
HeadMethodConfig = MedusaConfig | EagleConfig | RedrafterConfig
MethodConfig = VanillaConfig | DraftModelConfig | PromptLookupConfig | LookaheadConfig | \
    HeadMethodConfig


def options_of(cls) -> tuple[str, ...]:
    """The option names a config class takes."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "method")


def method_config(method: str, **options) -> MethodConfig:
    """The config of `method` with `options` (an option of another method is refused, naming
    the methods it belongs to)."""
    if method not in CONFIGS:
        raise MethodError(f"unknown method '{method}' (available: {', '.join(METHODS)})")
    cls = CONFIGS[method]
    own = options_of(cls)
    for key in options:
        if key not in own:
            users = [m for m, c in CONFIGS.items() if key in options_of(c)]
            if not users:
                raise MethodError(f"unknown option `{key}` (options of {method}: "
                                  f"{', '.join(own) or 'none'})")
            raise MethodError(f"`{key}` applies to {', '.join(users)}, not {method}")
    return cls(method=method, **options) if cls is EagleConfig else cls(**options)


def given_options(config: MethodConfig) -> dict:
    """The options of `config` that differ from its class's defaults (the method excluded)."""
    default = type(config)() if not isinstance(config, EagleConfig) else EagleConfig()
    return {k: getattr(config, k) for k in options_of(type(config))
            if getattr(config, k) != getattr(default, k)}
