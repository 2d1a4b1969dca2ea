"""Your own jitted decoding loop, built from specjax's pure speculative-decoding pieces.

specjax's `Engine.generate` runs a ready-made loop. This example writes that loop itself, as
plain JAX: one `jax.lax.while_loop`, compiled once with `jax.jit`, whose body calls the five pure
functions of one speculative step (docs/design.md, "One speculative step"):

    proposer.propose -> verify_pruned -> accept -> commit -> proposer.update

Because the loop is yours, you can change what it does. Here it adds two things the library's
loop does not have, both computed on device inside the loop (no host callbacks):
  * a custom stop rule: stop at the end of the first line (any token whose text holds a
    newline), at EOS, or after --max-new-tokens tokens;
  * a metric carried through the loop: a histogram of how many drafted tokens each step accepted.

The method is EAGLE-2 on the embedded SmolLM2-135M, with the heads that ship in
specjax/shipped_heads/ and their recommended setting (prompt lookup grafted on). Every piece
comes from the public namespace `specjax.step_pieces`. Decoding is greedy, so the tokens equal
`specjax generate --method eagle2` cut after the first line (tests/test_examples.py checks
exactly that).

    python examples/custom_loop.py --prompt "Write a short poem about the sea."
    python examples/custom_loop.py --smoke          # few tokens (also SPECJAX_EXAMPLES_SMOKE=1)
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import settings
from specjax import step_pieces as sp
from specjax.sampling import SamplingConfig

SMOKE = settings.examples_smoke()


class Carry(NamedTuple):
    """Everything the loop threads from one step to the next (all arrays, batch first)."""

    tokens: jax.Array  # int32[B, S]: prompt, then generated tokens
    lengths: jax.Array  # int32[B]: tokens so far; tokens[length - 1] is "pending" (see below)
    prompt_lengths: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    cache: sp.PagedKVCache  # the target's KV cache: K/V of tokens[:, :length - 1]
    features: jax.Array  # float[B, D]: target hidden state that predicted the pending token
    drafter: Any  # the proposer's own state (EAGLE: its draft network's KV cache)
    keys: jax.Array  # one PRNG key per sequence (used only when sampling)
    steps: jax.Array  # int32[B]: target forward passes so far
    accepted_hist: jax.Array  # int32[B, T]: steps that accepted exactly k drafted tokens


def start(model, proposer, drafter_params, prompts, max_new_tokens, seed=0, page_size=16):
    """Prefill the prompts and initialise the drafter: the loop's first carry.

    Shapes are rounded with `bucket` as `Engine` rounds them, so every computation has the same
    shapes as in `specjax generate` and the greedy tokens are the same.
    """
    config, b, dtype = model.config, len(prompts), model.params["embed"].dtype
    lens = np.array([len(p) for p in prompts], np.int32)
    # A paged KV cache of our own: sequence i owns pages i*n .. i*n + n - 1. Room for the prompt,
    # the answer and the draft tree's scratch slots (verify writes the tree after the prefix).
    longest = int(lens.max()) + max_new_tokens + sp.scratch_slots(proposer)
    n = sp.pages_needed(sp.bucket(longest), page_size)
    k_pages, v_pages = sp.init_pages(config, b * n, page_size, dtype)
    table = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    cache = sp.PagedKVCache(k_pages, v_pages, table, jnp.zeros(b, jnp.int32))
    # specjax's convention: the cache holds every token but the last one, which is "pending" and
    # is the first input of the next target pass. So prefill writes prompt[:-1].
    tokens = np.zeros((b, n * page_size + 1), np.int32)
    chunk = np.zeros((b, sp.bucket(int(lens.max()) - 1)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        chunk[i, : len(p) - 1] = p[:-1]
    feature_layers = tuple(proposer.feature_layers)  # EAGLE-3 reads 3 layers
    cache, features, prompt_hidden = sp.prefill(model.params, config, cache, chunk, lens - 1, feature_layers)
    # The drafter reads the prompt's features once (EAGLE fills its own draft KV cache).
    ctx = sp.SpecContext(tokens, lens, cache.block_tables, features, prompt_hidden=prompt_hidden)
    pools = proposer.make_pools(b * n, page_size, dtype)
    drafter = sp.init_proposer(proposer, drafter_params, pools, ctx, chunk, lens - 1)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(seed, seed + b))
    return Carry(
        jnp.asarray(tokens),
        jnp.asarray(lens),
        jnp.asarray(lens),
        jnp.zeros(b, bool),
        cache,
        features,
        drafter,
        keys,
        jnp.zeros(b, jnp.int32),
        jnp.zeros((b, proposer.tree_size), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("config", "proposer"), donate_argnames=("carry",))
def decode(params, config, proposer, drafter_params, sampling, carry: Carry, stop_ids, max_new_tokens) -> Carry:
    """Speculative decoding until every sequence stopped: one `lax.while_loop`, all on device."""
    b = carry.tokens.shape[0]
    rows = jnp.arange(b)

    # Fresh keys per step, drawn as specjax's own loop draws them (unused when greedy).
    def step_keys(c, salt):
        return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.fold_in(k, n), salt))(c.keys, c.lengths)

    def step(c: Carry) -> Carry:
        active = ~c.done
        # 1. Propose: a draft tree per sequence; node 0 is the pending token.
        ctx = sp.SpecContext(c.tokens, c.lengths, c.cache.block_tables, c.features)
        tree, drafter = proposer.propose(drafter_params, c.drafter, ctx, step_keys(c, 1), sampling)
        # 2. Verify: ONE target forward pass over every node of every tree (tree attention mask).
        logits, hidden, cache = sp.verify_pruned(
            params, config, c.cache, tree, proposer.feature_layers, proposer.likely_widths
        )
        # 3. Accept: the longest root path whose tokens the target agrees with (lossless), and
        #    the target's own next token after it.
        result = sp.accept(tree, logits, step_keys(c, 2), sampling, proposer.rule, **proposer.rule_options)
        # 4. Commit: keep the accepted nodes' K/V in the cache, drop the rest of the tree.
        cache = sp.commit(cache, result.path, result.n_accepted, active, is_chain=proposer.is_chain)

        # Our stop rule. `new` holds the step's n accepted drafts, then the target's next token;
        # keep them up to the budget, and up to (including) the first stop token.
        new = sp.appended_tokens(tree, result)  # int32[B, T]
        pos = jnp.arange(new.shape[1])[None, :]
        budget = max_new_tokens - (c.lengths - c.prompt_lengths)
        keep = jnp.minimum(result.n_accepted + 1, budget)
        stop_here = jnp.isin(new, stop_ids) & (pos < keep[:, None])
        stopped = jnp.any(stop_here, axis=1)
        keep = jnp.where(stopped, jnp.argmax(stop_here, axis=1) + 1, keep)
        keep = jnp.where(active, keep, 0)  # finished sequences add nothing
        cols = jnp.where(pos < keep[:, None], c.lengths[:, None] + pos, c.tokens.shape[1])
        tokens = c.tokens.at[rows[:, None], cols].set(new, mode="drop")  # column S: dropped
        lengths = c.lengths + keep
        done = c.done | (active & (stopped | (lengths - c.prompt_lengths >= max_new_tokens)))

        # 5. Update the drafter with the target's true features along the accepted path; the
        #    deepest accepted node's features predict the next pending token.
        deepest = result.path[rows, result.n_accepted]
        features = jnp.where(active[:, None], hidden[rows, deepest], c.features)
        path_hidden = jnp.take_along_axis(hidden, result.path[:, :, None], axis=1)
        node_argmax = sp.nodes_argmax(proposer, logits)  # Lookahead reads it
        ctx = sp.SpecContext(tokens, lengths, cache.block_tables, features, path_hidden, node_argmax=node_argmax)
        drafter = proposer.update(drafter_params, drafter, ctx, result, active)

        # Our metric, kept in the carry: how many drafted tokens each step accepted.
        hist = c.accepted_hist.at[rows, result.n_accepted].add(active.astype(jnp.int32))
        return c._replace(
            tokens=tokens,
            lengths=lengths,
            done=done,
            cache=cache,
            features=features,
            drafter=drafter,
            steps=c.steps + active,
            accepted_hist=hist,
        )

    return jax.lax.while_loop(lambda c: jnp.any(~c.done), step, carry)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable: one batch)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="eagle2", help="any method of `specjax generate`")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--no-line-stop", action="store_true", help="stop at EOS and budget only")
    ap.add_argument("--smoke", action="store_true", help="few tokens (CI)")
    ap.add_argument("--json", action="store_true", help="one JSON line per prompt")
    args = ap.parse_args()
    smoke = args.smoke or SMOKE
    max_new = args.max_new_tokens or (24 if smoke else 128)
    texts = args.prompt or ["Write a short poem about the sea."]

    model = specjax.load_model(args.model)
    tok = model.tokenizer
    proposer, drafter_params = sp.make_proposer(args.method, model)  # shipped heads' setting
    if proposer is None:
        raise SystemExit("this loop is speculative: pick a method other than vanilla")
    prompts = [sp.encode_prompt(tok, t, raw=False) for t in texts]  # chat template, as the CLI
    stop = list(model.config.eos_token_ids)
    if not args.no_line_stop:  # every token whose text contains a newline ends the first line
        pieces = tok.batch_decode([[i] for i in range(model.config.vocab_size)])
        stop += [i for i, s in enumerate(pieces) if "\n" in s]
    stop_ids = jnp.asarray(stop, jnp.int32)
    sampling = SamplingConfig(temperature=args.temperature)

    carry = start(model, proposer, drafter_params, prompts, max_new)
    # Compile first (ahead of time, nothing runs), then time the decoding alone.
    compiled = decode.lower(
        model.params, model.config, proposer, drafter_params, sampling, carry, stop_ids, max_new
    ).compile()
    t0 = time.perf_counter()
    carry = jax.block_until_ready(compiled(model.params, drafter_params, sampling, carry, stop_ids, max_new))
    seconds = time.perf_counter() - t0

    tokens, lengths = np.asarray(carry.tokens), np.asarray(carry.lengths)
    steps, hist = np.asarray(carry.steps), np.asarray(carry.accepted_hist)
    rate = int((lengths - np.array([len(p) for p in prompts])).sum()) / seconds  # whole batch
    for i, text in enumerate(texts):
        ids = tokens[i, len(prompts[i]) : lengths[i]].tolist()
        answer = tok.decode(ids, skip_special_tokens=True)
        mean = len(ids) / max(int(steps[i]), 1)  # tokens per target pass (1.0 without drafts)
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": text,
                        "text": answer,
                        "token_ids": ids,
                        "new_tokens": len(ids),
                        "steps": int(steps[i]),
                        "mean_accepted": mean,
                        "tokens_per_s": rate,
                        "accepted_hist": hist[i].tolist(),
                    },
                    ensure_ascii=False,
                )
            )
            continue
        print(f"prompt: {text}\nanswer: {answer.strip()}")
        print("accepted drafts per step: " + ", ".join(f"{k}:{int(c)}" for k, c in enumerate(hist[i]) if c))
        print(f"mean_accepted={mean:.2f} tokens_per_s={rate:.1f} new_tokens={len(ids)} steps={int(steps[i])}")


if __name__ == "__main__":
    main()
