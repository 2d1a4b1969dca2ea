"""Decoding methods by name: build the proposer (and its parameters) a method needs."""

from __future__ import annotations

from pathlib import Path

import jax

from specjax.draft_tree import check_confidence_floor
from specjax.loading import Model, load_model
from specjax.proposers import DraftModelProposer, PromptLookupProposer, self_draft_params
from specjax.proposers.draft_model import self_draft_config

METHODS = ("vanilla", "draft", "pld", "medusa", "eagle", "eagle2", "eagle3", "redrafter",
           "lookahead")
DEFAULT_DRAFT_LAYERS = 8


class MethodError(ValueError):
    """Unknown method or options that do not fit it."""


# Trained heads shipped for embedded models, package data (so a wheel has them too):
# specjax/shipped_heads/<model name>/<kind>/.
SHIPPED_HEADS = Path(__file__).resolve().parent / "shipped_heads"
HEAD_KINDS = {"medusa": "medusa", "eagle": "eagle", "eagle2": "eagle", "eagle3": "eagle3",
              "redrafter": "redrafter"}


def shipped_heads(model: Model, method: str) -> Path | None:
    """The project's trained heads of `method` for an embedded model, when they exist."""
    if model.name is None or method not in HEAD_KINDS:
        return None
    path = SHIPPED_HEADS / model.name / HEAD_KINDS[method]
    return path if (path / "specjax.json").exists() else None


def heads_decoding_defaults(heads, method: str) -> dict:
    """The `make_proposer` options a head checkpoint recommends for `method` (may be empty).

    They were chosen by measurement on a CPU, where a wider tree costs a slower verify pass;
    on a GPU a pass over 64 nodes costs about one node's, so there (an empty result) the methods'
    own defaults apply: the papers' and TensorRT-LLM's (EAGLE-2 63/5/8, Medusa mc_sim_7b_63)."""
    import json

    if jax.default_backend() != "cpu":
        return {}
    meta_file = Path(heads) / "specjax.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return {}  # loading the heads reports what is wrong
    defaults = meta.get("decoding_defaults", {})
    return dict(defaults.get(method, {})) if isinstance(defaults, dict) else {}


def make_proposer(method: str, target: Model, *, max_draft_len: int = 4, use_logits: bool = False,
                  draft_layers: int | None = None, draft_model: str | None = None,
                  prompt_lookup_num_tokens: int = 10, max_matching_ngram_size: int = 3,
                  min_matching_ngram_size: int = 1, heads: str | None = None,
                  medusa_choices=None, posterior_threshold: float | None = None,
                  posterior_alpha: float = 0.3, eagle_choices=None,
                  eagle_total_tokens: int | None = None, eagle_depth: int | None = None,
                  eagle_top_k: int | None = None, eagle_draft_vocab: int | None = None,
                  min_draft_prob: float | None = None,
                  redrafter_num_beams: int | None = None,
                  redrafter_draft_len_per_beam: int | None = None,
                  redrafter_greedy_search: bool = True,
                  redrafter_warp_top_k: int | None = 50, lookahead=(7, 5, 7),
                  lookahead_accept_window: bool = False, lookup_tokens: int | None = None,
                  lookup_width: int | None = None):
    """(proposer, proposer_params) for `method`; (None, None) for vanilla decoding.

    draft: `draft_model` (a path or name of any model with the target's vocabulary), or else a
    self-draft of the target's first `draft_layers` layers (default 8) with its norm and head.
    lookahead: TensorRT-LLM's (W, N, G) = (max_window_size, max_ngram_size,
    max_verification_set_size); lookahead_accept_window: also accept the window's chains from
    the root (see LookaheadProposer.accept_window).
    Head methods: options left None take the head checkpoint's `decoding_defaults` for the
    method (the tree sizes its model card recommends), else the method's own defaults.
    lookup_tokens: graft a prompt-lookup chain of up to N tokens (n-grams of
    `min/max_matching_ngram_size`) onto a head method's tree (`LookupGraftProposer`);
    lookup_width: verify such a step at most that wide, the tree's last nodes giving way.
    """
    if lookup_tokens is not None:
        return _grafted(method, target, lookup_tokens, max_matching_ngram_size,
                        min_matching_ngram_size, lookup_width, locals())
    if lookup_width is not None:
        raise MethodError("--lookup-width applies with --lookup-tokens (a grafted lookup)")
    if min_draft_prob is not None:
        if method not in ("medusa", "eagle", "eagle2", "eagle3"):
            raise MethodError(f"--min-draft-prob applies to medusa and the eagle methods, "
                              f"not {method}")
        try:
            check_confidence_floor(min_draft_prob, "--min-draft-prob")
        except ValueError as e:
            raise MethodError(str(e)) from None
    if lookahead_accept_window and method != "lookahead":
        raise MethodError(f"--lookahead-accept-window applies to lookahead, not {method}")
    if method == "vanilla":
        return None, None
    if heads is None and method in HEAD_KINDS:
        found = shipped_heads(target, method)
        heads = None if found is None else str(found)
    if heads is not None and method in HEAD_KINDS:
        given = dict(medusa_choices=medusa_choices, eagle_choices=eagle_choices,
                     eagle_total_tokens=eagle_total_tokens, eagle_depth=eagle_depth,
                     eagle_top_k=eagle_top_k, eagle_draft_vocab=eagle_draft_vocab,
                     min_draft_prob=min_draft_prob, redrafter_num_beams=redrafter_num_beams,
                     redrafter_draft_len_per_beam=redrafter_draft_len_per_beam)
        filled = {k: v for k, v in heads_decoding_defaults(heads, method).items()
                  if k in given and given[k] is None}
        if filled:
            return make_proposer(method, target, heads=heads, posterior_threshold=posterior_threshold,
                                 posterior_alpha=posterior_alpha,
                                 redrafter_greedy_search=redrafter_greedy_search,
                                 redrafter_warp_top_k=redrafter_warp_top_k,
                                 **{**{k: v for k, v in given.items() if v is not None}, **filled})
    if method == "pld":
        return PromptLookupProposer(prompt_lookup_num_tokens, max_matching_ngram_size,
                                    min_matching_ngram_size), None
    if method == "draft":
        if draft_model is not None and draft_layers is not None:
            raise MethodError("give either a draft model or draft layers, not both")
        if draft_model is not None:
            draft = load_model(draft_model, dtype=target.params["embed"].dtype)
            if draft.config.vocab_size != target.config.vocab_size:
                raise MethodError(
                    f"draft model vocabulary {draft.config.vocab_size} differs from the target's "
                    f"{target.config.vocab_size}")
            return DraftModelProposer(draft.config, max_draft_len, use_logits), draft.params
        n = DEFAULT_DRAFT_LAYERS if draft_layers is None else draft_layers
        n = min(n, target.config.num_layers) if draft_layers is None else n
        if not 1 <= n <= target.config.num_layers:
            raise MethodError(f"draft layers must be in [1, {target.config.num_layers}], got {n}")
        return (DraftModelProposer(self_draft_config(target.config, n), max_draft_len, use_logits),
                self_draft_params(target.params, n))
    if method == "medusa":
        return _medusa(target, heads, medusa_choices, posterior_threshold, posterior_alpha,
                       min_draft_prob)
    if method in ("eagle", "eagle2", "eagle3"):
        return _eagle(target, method, heads, eagle_choices,
                      {"total_tokens": eagle_total_tokens, "depth": eagle_depth,
                       "top_k": eagle_top_k}, eagle_draft_vocab, min_draft_prob)
    if method == "lookahead":
        return _lookahead(target, lookahead, lookahead_accept_window), None
    if method == "redrafter":
        from specjax.proposers.redrafter import make_redrafter

        if heads is None:
            raise MethodError("--method redrafter needs --heads PATH (a specjax ReDrafter head "
                              "checkpoint)")
        try:
            return make_redrafter(target, heads, num_beams=redrafter_num_beams or 5,
                                  draft_len_per_beam=redrafter_draft_len_per_beam or 5,
                                  greedy_search=redrafter_greedy_search,
                                  warp_top_k=redrafter_warp_top_k)
        except ValueError as e:
            if isinstance(e, MethodError) or type(e).__name__ == "CheckpointError":
                raise
            raise MethodError(str(e)) from None
    raise MethodError(f"unknown method '{method}' (available: {', '.join(METHODS)})")


def _grafted(method: str, target: Model, lookup_tokens: int, max_ngram: int, min_ngram: int,
             width: int | None, options: dict):
    """`method`'s proposer with a prompt-lookup chain grafted onto its trees."""
    from specjax.proposers.lookup_graft import LookupGraftProposer

    if method not in HEAD_KINDS:
        raise MethodError(f"--lookup-tokens grafts prompt lookup onto a head method's tree "
                          f"({', '.join(HEAD_KINDS)}), not {method}")
    try:
        lookup = PromptLookupProposer(int(lookup_tokens), max_ngram, min_ngram)
    except ValueError as e:
        raise MethodError(f"--lookup-tokens: {e}") from None
    options = {k: v for k, v in options.items()
               if k not in ("method", "target", "lookup_tokens", "lookup_width")}
    base, params = make_proposer(method, target, **options)
    try:
        return LookupGraftProposer(base, lookup, width=width), params
    except ValueError as e:
        raise MethodError(f"--lookup-width: {e}" if "width" in str(e) else str(e)) from None


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
        raise MethodError(f"lookahead window (W={w}, N={n}) reaches {proposer.span} positions "
                          f"ahead, more than the model's context of {context} tokens allows")
    return proposer


def _eagle(target: Model, method: str, heads: str | None, eagle_choices, tree_options: dict,
           draft_vocab: int | None = None, min_prob: float | None = None):
    """EAGLE-1 (static tree, `eagle_choices`), EAGLE-2 (dynamic tree) over EAGLE heads, or
    EAGLE-3 (dynamic tree) over EAGLE-3 heads; min_prob: the draft-confidence floor."""
    from specjax.cpu.draft_weights import draft_weights
    from specjax.model import lm_head_weight
    from specjax.proposers.eagle import EagleDynamicProposer, EagleTreeProposer

    if heads is None:
        kind = "EAGLE-3" if method == "eagle3" else "EAGLE"
        raise MethodError(f"--method {method} needs --heads PATH (a specjax {kind} head checkpoint)")
    dtype = target.params["embed"].dtype
    cast = lambda tree: jax.tree_util.tree_map(  # noqa: E731  (integer maps keep their type)
        lambda a: a.astype(dtype) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a, tree)
    network = {}
    if method == "eagle3":
        from specjax.heads import check_compatible
        from specjax.proposers.eagle3_net import feature_layers_of, load_eagle3_heads

        config, net, meta = load_eagle3_heads(heads)
        check_compatible(meta, target.config, heads)
        network = {"variant": "eagle3",
                   "feature_layers": feature_layers_of(meta, target.config.num_layers)}
    else:
        from specjax.proposers.eagle_net import load_eagle_heads

        config, net = load_eagle_heads(heads, target.config)
    params = {"net": cast(net), "embed": target.params["embed"],
              "lm_head": lm_head_weight(target.params)}
    if method == "eagle3" and draft_vocab is not None:
        raise MethodError("--eagle-draft-vocab is an EAGLE-1/2 option: EAGLE-3 heads have their "
                          "own draft vocabulary")
    if method != "eagle3" and ("draft_ids" in net or draft_vocab is not None):
        from specjax.proposers.eagle_net import draft_vocabulary

        ids = net.pop("draft_ids", jax.numpy.arange(target.config.vocab_size))
        params["net"].pop("draft_ids", None)
        try:
            params["lm_head"], params["draft_ids"] = draft_vocabulary(params["lm_head"], ids,
                                                                      draft_vocab)
        except ValueError as e:
            raise MethodError(str(e)) from None
    # the fc as `linear` takes it ([D, 2D], EAGLE-3 [D, 3D]), and the draft's own products in
    # the draft weights type on the CPU kernel (`draft_weights`; the target's embedding stays)
    params["net"]["fc"] = {**params["net"]["fc"], "weight": params["net"]["fc"]["kernel"].T}
    del params["net"]["fc"]["kernel"]
    own = ("layers", "fc", "lm_head") if method == "eagle3" else ("layers", "fc")
    params["net"] = {**params["net"], **draft_weights(
        {k: v for k, v in params["net"].items() if k in own})}
    if "lm_head" in params and method != "eagle3":
        params["lm_head"] = draft_weights(params["lm_head"])
    given = {k: v for k, v in tree_options.items() if v is not None}
    if min_prob is not None:
        network["min_prob"] = float(min_prob)
    try:
        if method == "eagle":
            if given:
                raise MethodError("--eagle-total-tokens/--eagle-depth/--eagle-top-k are "
                                  "EAGLE-2 options; EAGLE-1 takes --eagle-choices")
            if eagle_choices is None:
                return EagleTreeProposer(config, **network), params
            return EagleTreeProposer(config, eagle_choices=tuple(map(tuple, eagle_choices)),
                                     **network), params
        if eagle_choices is not None:
            raise MethodError(f"--eagle-choices is an EAGLE-1 option (eagle); {method} builds "
                              "its tree from --eagle-total-tokens/--eagle-depth/--eagle-top-k")
        return EagleDynamicProposer(config, **network, **given), params
    except MethodError:
        raise
    except ValueError as e:
        raise MethodError(str(e)) from None


def _medusa(target: Model, heads: str | None, medusa_choices, posterior_threshold,
            posterior_alpha, min_prob: float | None = None):
    from specjax.heads import check_compatible, load_heads
    from specjax.model import lm_head_weight
    from specjax.proposers.medusa import MC_SIM_7B_63, MEDUSA_TREES, MedusaProposer

    if heads is None:
        raise MethodError("--method medusa needs --heads PATH (a specjax Medusa head checkpoint)")
    meta, variables = load_heads(heads, "medusa")
    check_compatible(meta, target.config, heads)
    num_heads = int(meta["num_heads"])
    if isinstance(medusa_choices, str):  # a named tree, cut to the heads there are
        if medusa_choices.lower() not in MEDUSA_TREES:
            raise MethodError(f"unknown medusa_choices '{medusa_choices}' (a named tree: "
                              f"{', '.join(MEDUSA_TREES)}, or a list of paths)")
        medusa_choices = [c for c in MEDUSA_TREES[medusa_choices.lower()] if len(c) <= num_heads]
    if medusa_choices is None:  # the default tree, cut to the heads there are
        medusa_choices = [c for c in MC_SIM_7B_63 if len(c) <= num_heads]
    proposer = MedusaProposer(num_heads=num_heads, num_layers=int(meta["num_layers"]),
                              vocab_size=target.config.vocab_size,
                              medusa_choices=tuple(map(tuple, medusa_choices)),
                              own_lm_head=bool(meta.get("own_lm_head", True)),
                              posterior_threshold=posterior_threshold,
                              posterior_alpha=posterior_alpha, min_prob=min_prob or 0.0)
    dtype = target.params["embed"].dtype
    variables = dict(variables)
    ids = variables.pop("draft_ids", None)
    variables = jax.tree_util.tree_map(lambda a: a.astype(dtype), variables)
    params = {"heads": variables, "lm_head": lm_head_weight(target.params)}
    if ids is not None and not proposer.own_lm_head:  # draft from frequent tokens' rows only
        from specjax.proposers.eagle_net import draft_vocabulary

        if ids.shape[0] < proposer.top_k:
            raise MethodError(f"{heads} drafts from {ids.shape[0]} tokens, fewer than the "
                              f"tree's top-{proposer.top_k}")
        params["lm_head"], params["draft_ids"] = draft_vocabulary(params["lm_head"], ids, None)
    if not proposer.own_lm_head:  # the heads' shared product in the draft weights type
        from specjax.cpu.draft_weights import draft_weights

        params["lm_head"] = draft_weights(params["lm_head"])
    return proposer, params
