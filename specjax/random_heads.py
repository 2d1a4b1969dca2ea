"""Head checkpoints with random weights for any target model: the head methods end to end
(checkpoint, loading, proposer) without training, for tests and the GPU check."""

from __future__ import annotations

import dataclasses

import jax

from specjax.heads import save_heads
from specjax.model import init_params, lm_head_weight


def random_head_checkpoint(method: str, target, out):
    """A head checkpoint of `method` (medusa, eagle, eagle3, redrafter, dflash) with random weights for
    `target` (a `Model`), saved to out: the methods' real loading path, without training."""
    c = target.config
    key = jax.random.PRNGKey(0)
    meta = {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size}
    if method == "medusa":
        from specjax.proposers.medusa import MedusaProposer

        p = MedusaProposer(num_heads=4, vocab_size=c.vocab_size, own_lm_head=False)
        heads = p.init_params(key, c.hidden_size, lm_head_weight(target.params))
        heads = jax.tree_util.tree_map(lambda a: a + 0.02 * jax.random.normal(key, a.shape), heads)
        return save_heads(out, "medusa", heads, {**meta, "num_heads": 4, "num_layers": 1, "own_lm_head": False})
    if method == "eagle3":
        from specjax.proposers.eagle3_net import init_eagle3_params, save_eagle3_heads

        cfg3, net = init_eagle3_params(key, c, min(2048, c.vocab_size), scale=0.02)
        return save_eagle3_heads(out, cfg3, net, {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size})
    if method == "dflash":
        from specjax.proposers.dflash_net import random_dflash_checkpoint

        return random_dflash_checkpoint(target, out)
    if method == "redrafter":
        from specjax.proposers.redrafter import ReDrafterProposer, head_meta, save_redrafter

        p = ReDrafterProposer(c.hidden_size, c.vocab_size)
        return save_redrafter(out, p.init_params(key, scale=0.5), head_meta(p))
    cfg = dataclasses.replace(c, num_layers=1)
    layer = init_params(cfg, key, scale=0.02)["layers"][0]
    del layer["attn_norm"]
    fc = {
        "kernel": 0.02 * jax.random.normal(key, (2 * c.hidden_size, c.hidden_size)),
        "bias": jax.numpy.zeros((c.hidden_size,)),
    }
    return save_heads(out, "eagle", {"fc": fc, "layers": {"0": layer}}, {**meta, "config": cfg.to_hf()})
