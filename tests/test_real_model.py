"""The embedded SmolLM2-135M-Instruct: greedy output equals transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from specjax import Engine, load_model
from specjax.cli import encode_prompt

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in one sentence: The cat sat on the mat all afternoon, watching birds.",
]


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m")


def test_greedy_matches_transformers_generate(smol):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(smol.path), dtype=torch.float32).eval()
    eng = Engine(smol.params, smol.config, num_pages=64, page_size=16)
    encoded = [encode_prompt(smol.tokenizer, p, raw=False) for p in PROMPTS]
    ours = eng.generate(encoded, max_new_tokens=32, eos_token_ids=())
    for prompt, got in zip(encoded, ours.token_ids):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = out.sequences[0, len(prompt) :].tolist()
        if got != want:  # allowed only at a float32 near-tie: the two frameworks round differently
            i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            top2 = torch.topk(out.scores[i][0], 2).values
            assert float(top2[0] - top2[1]) < 1e-3, (i, got, want)
        assert len(got) == 32


def test_config_of_embedded_model(smol):
    c = smol.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and "lm_head" not in smol.params
    assert smol.tokenizer.decode(smol.tokenizer("Hello world").input_ids) == "Hello world"


def assert_same_or_near_tie(smol, prompt, want, got):
    """Equal greedy outputs, or a first difference at a float32 near-tie (rows are bit-identical
    across pass widths only on the CPU kernels: docs/design.md, "Acceptance, and why each rule
    is lossless")."""
    from specjax.greedy_check import compare

    verdict, i, gap = compare(smol.params, smol.config, prompt, want, got)
    assert verdict != "differ", f"outputs differ at token {i} where the top-2 gap is {gap}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,options",
    [("pld", {}), ("draft", {"draft_layers": 20}), ("draft", {"draft_layers": 10, "use_logits": True})],
)
def test_speculative_greedy_equals_vanilla(smol, method, options):
    from specjax.methods import make_proposer

    eng = Engine(smol.params, smol.config, num_pages=96, page_size=16)
    encoded = [encode_prompt(smol.tokenizer, p, raw=False) for p in PROMPTS]
    vanilla = eng.generate(encoded, max_new_tokens=64, eos_token_ids=())
    proposer, pparams = make_proposer(method, smol, **options)
    batched = eng.generate(encoded, 64, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    single = eng.generate(encoded[:1], 64, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    for prompt, want, got in zip(encoded, vanilla.token_ids, batched.token_ids):
        assert_same_or_near_tie(smol, prompt, want, got)
    assert_same_or_near_tie(smol, encoded[0], vanilla.token_ids[0], single.token_ids[0])
    assert sum(batched.steps) < sum(vanilla.steps)  # the drafts were accepted at least sometimes


# Dev prompts (chat, summarization) for the shipped heads' acceptance.
DEV_PROMPTS = [
    "Name three methods for authentication.",
    "Lisa: I'm holding seats for you\r\nLuck: Thanks!!\r\nHugh: I'll be there soon\r\n"
    "Lisa: Hurry up, people are looking at me with fury! \nGiven the above dialogue, "
    "write a summary.\n",
    "Tell the name of a famous mathematician.",
]
DEV_TOKENS = 48
# Tokens emitted minus target passes over DEV_PROMPTS (greedy, DEV_TOKENS each, the shipped
# heads at their recommended settings without the lookup graft), measured once on a 2-core Intel
# Xeon guest (2026-12-06): 144 tokens in 96 / 95 / 102 / 107 / 115 passes. Random heads in their
# place saved 0 passes (Medusa's 22), so the bound fails for each of them.
SHIPPED_MARGIN = {"eagle2": 48, "eagle1": 49, "eagle3": 42, "medusa": 37, "redrafter": 29}


@pytest.fixture(scope="module")
def dev_vanilla(smol):
    encoded = [encode_prompt(smol.tokenizer, p, raw=False) for p in DEV_PROMPTS]
    eng = Engine(smol.params, smol.config, num_pages=96, page_size=16)
    return eng, encoded, eng.generate(encoded, DEV_TOKENS, eos_token_ids=())


@pytest.mark.parametrize("method", list(SHIPPED_MARGIN))
def test_shipped_heads_are_accepted_and_lossless(smol, dev_vanilla, method):
    """The heads shipped for the embedded model draft tokens the target accepts: on dev prompts
    their greedy run saves at least 70% of the target passes it saved when measured, and emits
    vanilla's tokens. The graft is off, so the saving is the heads' own; random heads fail it."""
    from specjax.methods import make_proposer

    eng, encoded, vanilla = dev_vanilla
    proposer, pparams = make_proposer(method, smol, no_lookup=True)
    spec = eng.generate(
        encoded, DEV_TOKENS, eos_token_ids=(), proposer=proposer, proposer_params=pparams, fixed_speculation=True
    )
    for prompt, want, got in zip(encoded, vanilla.token_ids, spec.token_ids):
        assert_same_or_near_tie(smol, prompt, want, got)
    tokens, passes = sum(map(len, spec.token_ids)), sum(spec.steps)
    assert tokens - passes >= 0.7 * SHIPPED_MARGIN[method], (
        f"{method}: {tokens} tokens in {passes} target passes; measured {tokens - SHIPPED_MARGIN[method]}"
    )


@pytest.mark.slow
def test_random_heads_fail_the_acceptance_bound(smol, dev_vanilla, tmp_path):
    """The control of the test above: EAGLE-2 with random heads in the shipped ones' place keeps
    vanilla's tokens but saves too few passes to pass its bound."""
    from specjax.methods import make_proposer
    from specjax.random_heads import random_head_checkpoint

    eng, encoded, vanilla = dev_vanilla
    heads = random_head_checkpoint("eagle2", smol, tmp_path / "eagle2")
    proposer, pparams = make_proposer("eagle2", smol, heads=str(heads), no_lookup=True)
    spec = eng.generate(
        encoded, DEV_TOKENS, eos_token_ids=(), proposer=proposer, proposer_params=pparams, fixed_speculation=True
    )
    for prompt, want, got in zip(encoded, vanilla.token_ids, spec.token_ids):
        assert_same_or_near_tie(smol, prompt, want, got)
    assert sum(map(len, spec.token_ids)) - sum(spec.steps) < 0.7 * SHIPPED_MARGIN["eagle2"]


def test_methods_without_options_run_the_documented_defaults(smol):
    """`specjax generate --method M` on the embedded model builds what the README and
    docs/methods.md call M's default on a CPU: the shipped heads' recommended settings, a
    prompt-lookup graft of 5 tokens (EAGLE-2: 10 within a verify width of 12; n-grams of 2 or
    3) included; `no_lookup` drops the graft."""
    from specjax.method_configs import EagleConfig
    from specjax.methods import make_proposer
    from specjax.proposers.eagle import EagleDynamicProposer
    from specjax.proposers.lookup_graft import LookupGraftProposer

    def graft_of(proposer, tokens=5, width=None):
        assert isinstance(proposer, LookupGraftProposer)
        lookup = proposer.lookup
        assert (
            lookup.prompt_lookup_num_tokens,
            lookup.min_matching_ngram_size,
            lookup.max_matching_ngram_size,
            proposer.width,
        ) == (tokens, 2, 3, width)
        return proposer.base

    eagle2, params = make_proposer("eagle2", smol)
    base = graft_of(eagle2, tokens=10, width=12)
    assert isinstance(base, EagleDynamicProposer)
    assert (base.total_tokens, base.depth, base.top_k) == (4, 2, 2)
    assert params["lm_head"].shape[0] == params["draft_ids"].shape[0] == 4096
    assert make_proposer(EagleConfig(), smol)[0] == eagle2  # the config and the name agree
    plain, _ = make_proposer("eagle2", smol, no_lookup=True)
    assert plain == base
    eagle, _ = make_proposer("eagle1", smol)
    assert make_proposer("eagle", smol)[0] == eagle  # TensorRT-LLM's name for EAGLE-1
    assert graft_of(eagle).eagle_choices == ((0,), (1,), (0, 0))
    assert graft_of(eagle).rule == base.rule == "recursive"  # when sampling
    eagle3, _ = make_proposer("eagle3", smol)
    eagle3 = graft_of(eagle3)
    assert (eagle3.total_tokens, eagle3.depth, eagle3.top_k) == (4, 2, 2)
    medusa, _ = make_proposer("medusa", smol)
    medusa = graft_of(medusa)
    assert medusa.medusa_choices == ((0,), (1,), (0, 0)) and medusa.min_prob == 0.0
    assert medusa.rule == "recursive"
    redrafter, _ = make_proposer("redrafter", smol)
    redrafter = graft_of(redrafter)
    assert (redrafter.num_beams, redrafter.draft_len_per_beam) == (1, 3)
