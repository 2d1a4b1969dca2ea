"""The pure pieces of one speculative step, for a decoding loop of your own.

One step is `proposer.propose -> verify_pruned -> accept -> commit -> proposer.update`
(docs/design.md); `spec_step`/`spec_loop` are the library's own step and loop over the same
pieces. `examples/custom_loop.py` builds a jitted `lax.while_loop` from what is here:

    from specjax import step_pieces as sp
    proposer, drafter_params = sp.make_proposer(sp.EagleConfig(), model)
    cache, features, hidden = sp.prefill(params, config, cache, chunk, lengths)
    ...
"""

from specjax.accept import AcceptResult, accept
from specjax.batching import bucket
from specjax.cache import PagedKVCache, init_pages, pages_needed
from specjax.commit import commit
from specjax.decoding import prefill
from specjax.draft_tree import DraftTree
from specjax.method_configs import (
    DraftModelConfig,
    EagleConfig,
    LookaheadConfig,
    MedusaConfig,
    MethodError,
    PromptLookupConfig,
    RedrafterConfig,
    VanillaConfig,
    method_config,
)
from specjax.methods import make_proposer
from specjax.prompts import encode_prompt
from specjax.spec_decode import (
    Proposer,
    ProposerBase,
    SpecContext,
    SpecState,
    appended_tokens,
    init_proposer,
    nodes_argmax,
    scratch_slots,
    spec_loop,
    spec_step,
)
from specjax.verify import verify_pruned

__all__ = [
    "AcceptResult",
    "DraftModelConfig",
    "DraftTree",
    "EagleConfig",
    "LookaheadConfig",
    "MedusaConfig",
    "MethodError",
    "PagedKVCache",
    "PromptLookupConfig",
    "Proposer",
    "ProposerBase",
    "RedrafterConfig",
    "SpecContext",
    "SpecState",
    "VanillaConfig",
    "accept",
    "appended_tokens",
    "bucket",
    "commit",
    "encode_prompt",
    "init_pages",
    "init_proposer",
    "make_proposer",
    "method_config",
    "nodes_argmax",
    "pages_needed",
    "prefill",
    "scratch_slots",
    "spec_loop",
    "spec_step",
    "verify_pruned",
]
