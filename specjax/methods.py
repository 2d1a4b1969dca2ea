"""Decoding methods: build the proposer (and its parameters) a method config asks for."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from specjax.draft_tree import check_confidence_floor
from specjax.loading import Model, load_model
from specjax.method_configs import (  # noqa: F401
    ALIASES,
    CONFIGS,
    METHODS,
    DFlashConfig,
    DraftModelConfig,
    EagleConfig,
    HeadMethod,
    LookaheadConfig,
    MedusaConfig,
    MethodError,
    PromptLookupConfig,
    RedrafterConfig,
    SuffixConfig,
    VanillaConfig,
    as_flags,
    method_config,
)
from specjax.proposers import DraftModelProposer, PromptLookupProposer, self_draft_params
from specjax.proposers.draft_model import self_draft_config

DEFAULT_DRAFT_LAYERS = 8

# Trained heads shipped for embedded models, package data (so a wheel has them too):
# specjax/shipped_heads/<model name>/<kind>/. Which kind of heads each method reads (its config's heads_kind):
SHIPPED_HEADS = Path(__file__).resolve().parent / "shipped_heads"
HEAD_KINDS = {m: method_config(m).heads_kind for m, c in CONFIGS.items() if issubclass(c, HeadMethod)}


def shipped_heads(model: Model, method: str) -> Path | None:
    """The project's trained heads of `method` for an embedded model, when they exist."""
    if model.name is None or method not in HEAD_KINDS:
        return None
    path = SHIPPED_HEADS / model.name / HEAD_KINDS[method]
    return path if (path / "specjax.json").exists() else None


def heads_decoding_defaults(heads, method: str) -> dict:
    """The options a head checkpoint recommends for `method` (may be empty).

    They were chosen by measurement on a CPU, where a wider tree costs a slower verify pass;
    on a GPU a pass over 64 nodes costs about one node's, so there (an empty result) the methods'
    own defaults apply: the papers' and TensorRT-LLM's (EAGLE-2 63/5/8, Medusa mc_sim_7b_63)."""
    if jax.default_backend() != "cpu":
        return {}
    meta_file = Path(heads) / "specjax.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return {}  # loading the heads reports what is wrong
    defaults = meta.get("decoding_defaults", {})
    if not isinstance(defaults, dict):
        return {}
    aliases = [a for a, m in ALIASES.items() if m == method]  # heads written before a rename
    return dict(next((defaults[k] for k in (method, *aliases) if k in defaults), {}))


def recommended(config, target: Model):
    """`config` with its heads found (an embedded model's shipped heads when `heads` is None)
    and the options left None set to what those heads recommend (`heads_decoding_defaults`);
    `no_lookup` keeps a recommended prompt-lookup graft off."""
    if not isinstance(config, HeadMethod):
        return config
    heads = config.heads
    if heads is None:
        found = shipped_heads(target, config.method)
        heads = None if found is None else str(found)
    if heads is None:
        return config
    fill = {
        k: v
        for k, v in heads_decoding_defaults(heads, config.method).items()
        if k in {f.name for f in dataclasses.fields(config)} and getattr(config, k) is None
    }
    if config.no_lookup:
        lookup = ("lookup_tokens", "lookup_width", "lookup_method", "min_matching_ngram_size")
        fill = {k: v for k, v in fill.items() if k not in lookup}
    return dataclasses.replace(config, heads=heads, **fill)


def make_proposer(config, target: Model, **options):
    """(proposer, proposer_params) for a method config; (None, None) for vanilla decoding.

    `config` is a config of `specjax.method_configs` (`EagleConfig(eagle_total_tokens=10)`), or
    a method name with its options as keywords (`make_proposer("eagle2", model,
    eagle_total_tokens=10)`, the form `specjax bench` takes; its errors name options as flags).
    A head method's options left None take its heads' recommendation (`recommended`), else
    the method's own defaults; `lookup_tokens` grafts a prompt-lookup chain onto its tree
    (`LookupGraftProposer`).
    """
    if isinstance(config, str):
        try:
            return make_proposer(method_config(config, **options), target)
        except MethodError as e:
            raise MethodError(as_flags(str(e))) from None
    if options:
        raise TypeError("make_proposer takes keyword options with a method name, not a config")
    config = recommended(config, target)
    if isinstance(config, HeadMethod):
        if config.no_lookup and config.lookup_tokens is not None:
            raise MethodError("`no_lookup` and `lookup_tokens` contradict each other")
        if config.lookup_tokens is not None:
            return _grafted(config, target)
        if config.lookup_width is not None or config.lookup_method is not None:
            name = "lookup_width" if config.lookup_width is not None else "lookup_method"
            raise MethodError(f"`{name}` applies with `lookup_tokens` (a grafted lookup)")
    return _build(config, target)


def _build(config, target: Model):
    """The proposer of `config` as it stands (recommendations applied, no graft)."""
    if isinstance(config, VanillaConfig):
        return None, None
    if isinstance(config, PromptLookupConfig):
        try:
            return PromptLookupProposer(
                config.prompt_lookup_num_tokens, config.max_matching_ngram_size, config.min_matching_ngram_size or 1
            ), None
        except ValueError as e:
            raise MethodError(str(e)) from None
    if isinstance(config, SuffixConfig):
        from specjax.proposers.suffix import SuffixProposer
        from specjax.proposers.suffix_cache import SuffixCache

        tokens = config.suffix_decoding_max_cached_tokens
        if tokens == 1:
            raise MethodError("`suffix_decoding_max_cached_tokens` must be 0 (no cache) or >= 2, got 1")
        return SuffixProposer(
            max_nodes=config.suffix_max_draft_tokens + 1,
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            max_spec_offset=config.suffix_decoding_max_spec_offset,
            min_token_prob=config.suffix_decoding_min_token_prob,
            max_match=config.suffix_max_match,
        ), (SuffixCache(config.suffix_max_match, tokens) if tokens else None)
    if isinstance(config, DraftModelConfig):
        return _draft_model(config, target)
    if isinstance(config, MedusaConfig):
        return _medusa(target, config)
    if isinstance(config, EagleConfig):
        return _eagle(target, config)
    if isinstance(config, LookaheadConfig):
        return _lookahead(target, config.lookahead, config.lookahead_accept_window), None
    if isinstance(config, RedrafterConfig):
        return _redrafter(target, config)
    if isinstance(config, DFlashConfig):
        return _dflash(target, config)
    raise MethodError(f"not a method config: {config!r}")


def _draft_model(config: DraftModelConfig, target: Model):
    if config.draft_model is not None:
        draft = load_model(config.draft_model, dtype=target.params["embed"].dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise MethodError(
                f"draft model vocabulary {draft.config.vocab_size} differs from the target's {target.config.vocab_size}"
            )
        return (DraftModelProposer(draft.config, config.max_draft_len, config.use_logits), draft.params)
    n = config.draft_layers
    n = min(DEFAULT_DRAFT_LAYERS, target.config.num_layers) if n is None else n
    if not 1 <= n <= target.config.num_layers:
        raise MethodError(f"draft layers must be in [1, {target.config.num_layers}], got {n}")
    return (
        DraftModelProposer(self_draft_config(target.config, n), config.max_draft_len, config.use_logits),
        self_draft_params(target.params, n),
    )


def _redrafter(target: Model, config: RedrafterConfig):
    from specjax.proposers.redrafter import make_redrafter

    if config.heads is None:
        raise MethodError("method redrafter needs `heads` PATH (a specjax ReDrafter head checkpoint)")
    try:
        return make_redrafter(
            target,
            config.heads,
            num_beams=config.redrafter_num_beams or 5,
            draft_len_per_beam=config.redrafter_draft_len_per_beam or 5,
            greedy_search=config.redrafter_greedy_search,
            warp_top_k=config.redrafter_warp_top_k,
        )
    except ValueError as e:
        if isinstance(e, MethodError) or type(e).__name__ == "CheckpointError":
            raise
        raise MethodError(str(e)) from None


def _dflash(target: Model, config: DFlashConfig):
    """DFlash over a specjax "dflash" head checkpoint or a directory in the public format."""
    from specjax.proposers.dflash import DFlashProposer
    from specjax.proposers.dflash_format import load_dflash

    if config.heads is None:
        raise MethodError("method dflash needs `heads` PATH (DFlash drafter weights: specjax or the public format)")
    try:
        draft, params, meta = load_dflash(config.heads, target)
        tree = config.dflash_tree_budget
        proposer = DFlashProposer(
            draft,
            target_layers=meta["target_layers"],
            mask_token_id=int(meta["mask_token_id"]),
            block_size=config.dflash_block_size or int(meta["block_size"]),
            tree_budget=tree,
            top_k=config.dflash_top_k,
            acceptance=config.dflash_acceptance,
        )
    except ValueError as e:
        if type(e).__name__ == "CheckpointError":
            raise
        raise MethodError(str(e)) from None
    return proposer, params


def _grafted(config, target: Model):
    """The head method's proposer with a prompt-lookup chain grafted onto its trees."""
    from specjax.proposers.lookup_graft import LookupGraftProposer

    try:
        cache = None
        if config.lookup_method == "suffix":
            from specjax.proposers.suffix import SuffixProposer
            from specjax.proposers.suffix_cache import SuffixCache

            lookup = SuffixProposer(max_nodes=int(config.lookup_tokens) + 1, is_chain=True)
            cache = SuffixCache(lookup.max_match, SuffixConfig().suffix_decoding_max_cached_tokens)
        else:
            lookup = PromptLookupProposer(
                int(config.lookup_tokens), config.max_matching_ngram_size, config.min_matching_ngram_size or 1
            )
    except ValueError as e:
        raise MethodError(f"`lookup_tokens`: {e}") from None
    plain = dict(lookup_tokens=None, lookup_width=None, lookup_method=None)
    base, params = _build(dataclasses.replace(config, **plain), target)
    try:
        graft = LookupGraftProposer(base, lookup, width=config.lookup_width, lookup_params=cache is not None)
        return graft, (params if cache is None else {"base": params, "lookup": cache})
    except ValueError as e:
        raise MethodError(f"`lookup_width`: {e}" if "width" in str(e) else str(e)) from None


def _lookahead(target: Model, wng, accept_window: bool = False):
    """LookaheadProposer for (W, N, G), refused when its window does not fit the context."""
    from specjax.proposers.lookahead import LookaheadProposer

    try:
        w, n, g = (int(x) for x in wng)
        proposer = LookaheadProposer(w, n, g, accept_window=bool(accept_window))
    except (TypeError, ValueError) as e:
        raise MethodError(f"lookahead (W, N, G) {tuple(wng)}: {e}") from None
    context = target.config.max_position_embeddings
    if proposer.span >= context:
        raise MethodError(
            f"lookahead window (W={w}, N={n}) reaches {proposer.span} positions "
            f"ahead, more than the model's context of {context} tokens allows"
        )
    return proposer


def _check_floor(min_prob):
    if min_prob is not None:
        try:
            check_confidence_floor(min_prob, "`min_draft_prob`")
        except ValueError as e:
            raise MethodError(str(e)) from None


def _default_rule(options, paths=None) -> str:
    """The sampling rule when `acceptance` is left out: `recursive` wherever the tree can be
    drawn for it (it accepted more than `match` and ran faster in the sampled benchmarks,
    docs/benchmarks.md "Sampling"), else `match`. `paths`: a static tree's (Medusa's, EAGLE-1's),
    drawable when no node's children skip a rank; without, the EAGLE-2/3 tree of `options` (an
    EagleConfig), which must fit beams of top_k per depth (`EagleDynamicProposer.levels`).
    Greedy decoding is the same under both rules."""
    from specjax.draft_tree import skipped_draw
    from specjax.proposers.eagle import EagleDynamicProposer as tree
    from specjax.proposers.medusa import expand_choices

    if paths is not None:
        return "match" if skipped_draw(expand_choices(paths)) else "recursive"
    pick = lambda given, default: default if given is None else given
    fits = tree.recursive_fits(
        pick(options.eagle_total_tokens, tree.total_tokens),
        pick(options.eagle_depth, tree.depth),
        pick(options.eagle_top_k, tree.top_k),
    )
    return "recursive" if fits else "match"


def _eagle(target: Model, options: EagleConfig):
    """EAGLE-1 (static tree, `eagle_choices`), EAGLE-2 (dynamic tree) over EAGLE heads, or
    EAGLE-3 (dynamic tree) over EAGLE-3 heads."""
    from specjax.proposers.eagle import EAGLE_DEFAULT_TREE, EagleDynamicProposer, EagleTreeProposer
    from specjax.proposers.eagle3_net import load_eagle3
    from specjax.proposers.eagle_net import load_eagle

    method, heads = options.method, options.heads
    _check_floor(options.min_draft_prob)
    if heads is None:
        kind = "EAGLE-3" if method == "eagle3" else "EAGLE"
        raise MethodError(f"method {method} needs `heads` PATH (a specjax {kind} head checkpoint)")
    try:
        net, config, params = (load_eagle3 if method == "eagle3" else load_eagle)(
            heads, target, options.eagle_draft_vocab
        )
    except ValueError as e:
        if type(e).__name__ == "CheckpointError":
            raise
        raise MethodError(str(e)) from None
    tree = {"total_tokens": options.eagle_total_tokens, "depth": options.eagle_depth, "top_k": options.eagle_top_k}
    given = {k: v for k, v in tree.items() if v is not None}
    network = {"net": net}
    if options.min_draft_prob is not None:
        network["min_prob"] = float(options.min_draft_prob)
    eagle_choices = options.eagle_choices
    try:
        if method == "eagle1":
            if given:
                raise MethodError(
                    "`eagle_total_tokens`/`eagle_depth`/`eagle_top_k` are "
                    "EAGLE-2 options; EAGLE-1 takes `eagle_choices`"
                )
            tree = EAGLE_DEFAULT_TREE if eagle_choices is None else tuple(map(tuple, eagle_choices))
            network["rule"] = options.acceptance or _default_rule(options, tree)
            return EagleTreeProposer(config, eagle_choices=tree, **network), params
        network["rule"] = options.acceptance or _default_rule(options)
        if eagle_choices is not None:
            raise MethodError(
                f"`eagle_choices` is an EAGLE-1 option (eagle1); {method} builds "
                "its tree from `eagle_total_tokens`/`eagle_depth`/`eagle_top_k`"
            )
        return EagleDynamicProposer(config, **network, **given), params
    except MethodError:
        raise
    except ValueError as e:
        raise MethodError(str(e)) from None


def _medusa(target: Model, config: MedusaConfig):
    from specjax.heads import check_compatible, load_heads
    from specjax.model import lm_head_weight
    from specjax.proposers.medusa import MC_SIM_7B_63, MEDUSA_TREES, MedusaProposer

    heads, medusa_choices, min_prob = config.heads, config.medusa_choices, config.min_draft_prob
    _check_floor(min_prob)
    if heads is None:
        raise MethodError("method medusa needs `heads` PATH (a specjax Medusa head checkpoint)")
    meta, variables = load_heads(heads, "medusa")
    check_compatible(meta, target.config, heads)
    num_heads = int(meta["num_heads"])
    if isinstance(medusa_choices, str):  # a named tree (checked by MedusaConfig), cut to the heads
        medusa_choices = [c for c in MEDUSA_TREES[medusa_choices] if len(c) <= num_heads]
    if medusa_choices is None:  # the default tree, cut to the heads there are
        medusa_choices = [c for c in MC_SIM_7B_63 if len(c) <= num_heads]
    try:
        proposer = MedusaProposer(
            num_heads=num_heads,
            num_layers=int(meta["num_layers"]),
            vocab_size=target.config.vocab_size,
            medusa_choices=tuple(map(tuple, medusa_choices)),
            own_lm_head=bool(meta.get("own_lm_head", True)),
            posterior_threshold=config.posterior_threshold,
            posterior_alpha=config.posterior_alpha,
            min_prob=min_prob or 0.0,
            acceptance=config.acceptance
            or ("match" if config.posterior_threshold is not None else _default_rule(config, medusa_choices)),
        )
    except ValueError as e:
        raise MethodError(str(e)) from None
    dtype = target.params["embed"].dtype
    variables = dict(variables)
    ids = variables.pop("draft_ids", None)
    variables = jax.tree_util.tree_map(lambda a: a.astype(dtype), variables)
    params = {"heads": variables, "lm_head": lm_head_weight(target.params)}
    if ids is not None and not proposer.own_lm_head:  # draft from frequent tokens' rows only
        from specjax.proposers.eagle_net import draft_vocabulary

        if ids.shape[0] < proposer.top_k:
            raise MethodError(f"{heads} drafts from {ids.shape[0]} tokens, fewer than the tree's top-{proposer.top_k}")
        params["lm_head"], params["draft_ids"] = draft_vocabulary(params["lm_head"], ids, None)
    if not proposer.own_lm_head:  # the heads' shared product in the draft weights type
        from specjax.cpu.draft_weights import draft_weights

        params["lm_head"] = draft_weights(params["lm_head"])
    return proposer, params
