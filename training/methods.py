"""Trainable drafting methods: what each reads, its parameters, loss, and exported checkpoint.

A method is a frozen (hashable) dataclass, so it is a static argument of the jitted train step.
It declares the features it needs (`feature_spec`), builds its trainable parameters, computes its
loss from a batch (base parameters are inputs, never trained), writes the specjax head checkpoint
that `specjax generate --heads` / the proposers load, and builds the proposer that evaluates it.
New methods (EAGLE-3, ReDrafter) register in METHODS with the same interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.model import init_params as init_model_params
from specjax.model import lm_head_weight
from training import losses
from training.features import FeatureSpec, scratch_cache


class TrainMethod:
    """Interface of a trainable method (documentation; methods below implement it)."""

    name: str  # CLI name
    kind: str  # head checkpoint kind (specjax.json "kind")
    num_outputs: int  # heads (or draft steps) reported with a top-1 accuracy each

    def feature_spec(self, config: ModelConfig, dtype: str) -> FeatureSpec: ...

    def init_params(self, key, base_params, config: ModelConfig) -> Any: ...

    def loss(self, params, base_params, config: ModelConfig, batch: dict, key) -> tuple: ...

    def export(self, params, config: ModelConfig) -> tuple[dict, dict]:
        """(flax-style variables dict, meta) for `specjax.heads.save_heads`."""

    def params_from_heads(self, path, config: ModelConfig) -> Any:
        """Trainable parameters from an existing head checkpoint (warm start)."""

    def proposer(self, heads_dir, model, **options) -> tuple[Any, Any]:
        """(proposer, proposer_params) decoding with the exported heads."""


@dataclasses.dataclass(frozen=True)
class MedusaMethod(TrainMethod):
    """Medusa-1: K heads (ResBlocks + vocabulary projection) on the frozen base's last features.

    own_lm_head=False shares the base's frozen lm_head (no [D, V] matrix per head: far fewer
    parameters, the sensible choice for small models on CPU); True gives each head its own
    projection, initialised from the base's lm_head as in Medusa.
    """

    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    decay: float = losses.MEDUSA_DECAY
    name: str = "medusa"
    kind: str = "medusa"

    @property
    def num_outputs(self) -> int:
        return self.num_heads

    def _module(self, config: ModelConfig):
        from specjax.proposers.medusa import MedusaHeads

        return MedusaHeads(self.num_heads, self.num_layers, config.vocab_size, self.own_lm_head)

    def feature_spec(self, config, dtype="float16"):
        return FeatureSpec(final=True, dtype=dtype)

    def init_params(self, key, base_params, config):
        head = lm_head_weight(base_params).astype(jnp.float32)
        variables = self._module(config).init(key, jnp.zeros((1, config.hidden_size)), head)
        if self.own_lm_head:  # start from the base's head, as Medusa does
            params = dict(variables["params"])
            for k in range(self.num_heads):
                h = dict(params[f"head_{k}"])
                h["Dense_0"] = {"kernel": head.T}
                params[f"head_{k}"] = h
            variables = {"params": params}
        return variables

    def logits(self, params, base_params, config, features):
        """Head logits [B, T, K, V] of features [B, T, D]."""
        b, t, d = features.shape
        out = self._module(config).apply(params, features.reshape(b * t, d),
                                         lm_head_weight(base_params).astype(jnp.float32))
        return out.reshape(b, t, self.num_heads, -1)

    def loss(self, params, base_params, config, batch, key):
        logits = self.logits(params, base_params, config, batch["final"])
        return losses.medusa_loss(logits, batch["tokens"], batch["mask"] & batch["valid"],
                                  self.decay)

    def export(self, params, config):
        meta = {"num_heads": self.num_heads, "num_layers": self.num_layers,
                "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "own_lm_head": self.own_lm_head}
        return params, meta

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible, load_heads

        meta, variables = load_heads(path, "medusa")
        check_compatible(meta, config, path)
        want = (self.num_heads, self.num_layers, self.own_lm_head)
        got = (int(meta["num_heads"]), int(meta["num_layers"]), bool(meta.get("own_lm_head", True)))
        if got != want:
            raise ValueError(f"{path} holds Medusa heads (num_heads, num_layers, own_lm_head) = "
                             f"{got}, the run asks for {want}")
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), variables)

    def proposer(self, heads_dir, model, **options):
        from specjax.methods import make_proposer

        return make_proposer("medusa", model, heads=str(heads_dir),
                             medusa_choices=options.get("medusa_choices"))


@dataclasses.dataclass(frozen=True)
class EagleMethod(TrainMethod):
    """EAGLE-1 (used by EAGLE-2 too): fc([embed(t+1); f_t]) -> decoder layer(s) regress f_{t+1}.

    The target's embedding and lm_head are frozen inputs; the draft has the target's shapes with
    `num_layers` decoder layers, the first without input norm (SafeAILab/EAGLE).
    """

    num_layers: int = 1
    noise_std: float = losses.EAGLE_NOISE_STD
    v_w: float = losses.EAGLE_V_W
    p_w: float = losses.EAGLE_P_W
    name: str = "eagle"
    kind: str = "eagle"
    num_outputs: int = 1

    def draft_config(self, config: ModelConfig) -> ModelConfig:
        return dataclasses.replace(config, num_layers=self.num_layers)

    def feature_spec(self, config, dtype="float16"):
        return FeatureSpec(final=True, dtype=dtype)

    def init_params(self, key, base_params, config):
        k1, k2 = jax.random.split(key)
        layers = init_model_params(self.draft_config(config), k1, jnp.float32)["layers"]
        del layers[0]["attn_norm"]
        d = config.hidden_size
        fc = {"kernel": 0.02 * jax.random.normal(k2, (2 * d, d), jnp.float32),
              "bias": jnp.zeros((d,), jnp.float32)}
        return {"fc": fc, "layers": layers}

    def draft(self, params, base_params, config, tokens, features, valid):
        """Predicted next features [B, T, D] of (token t + 1, feature t) pairs, causal."""
        from specjax.model import causal_mask
        from specjax.proposers.eagle_net import eagle_forward

        b, t = tokens.shape
        dcfg = self.draft_config(config)
        cache = scratch_cache(dcfg, b, t, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        embed = base_params["embed"].astype(jnp.float32)
        out, _ = eagle_forward(params, dcfg, embed, tokens, features, positions, cache,
                               causal_mask(b, t), valid)
        return out

    def loss(self, params, base_params, config, batch, key):
        tokens, feats, target, mask = losses.eagle_shift(batch["tokens"], batch["final"],
                                                         batch["mask"], batch["valid"])
        if self.noise_std > 0:
            lengths = jnp.sum(batch["valid"], axis=1)
            noisy = losses.uniform_feature_noise(key, feats, lengths, self.noise_std)
            feats = jnp.where(batch["valid"][..., None], noisy, feats)
        pred = self.draft(params, base_params, config, tokens, feats, batch["valid"])
        return losses.eagle_loss(pred, target, lm_head_weight(base_params).astype(jnp.float32),
                                 mask, self.v_w, self.p_w)

    def export(self, params, config):
        variables = {"fc": params["fc"],
                     "layers": {str(i): layer for i, layer in enumerate(params["layers"])}}
        meta = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "config": self.draft_config(config).to_hf()}
        return variables, meta

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible, load_heads
        from specjax.proposers.eagle_net import load_eagle_heads

        meta, _ = load_heads(path, "eagle")
        check_compatible(meta, config, path)
        dcfg, params = load_eagle_heads(path)
        if dcfg.num_layers != self.num_layers:
            raise ValueError(f"{path} holds an EAGLE draft of {dcfg.num_layers} layers, the run "
                             f"asks for {self.num_layers}")
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)

    def proposer(self, heads_dir, model, **options):
        from specjax.heads import check_compatible, load_heads
        from specjax.proposers.eagle import EagleChainProposer
        from specjax.proposers.eagle_net import load_eagle_heads

        meta, _ = load_heads(heads_dir, "eagle")
        check_compatible(meta, model.config, heads_dir)
        dcfg, net = load_eagle_heads(heads_dir)
        dtype = model.params["embed"].dtype
        net = jax.tree_util.tree_map(lambda a: a.astype(dtype), net)
        proposer = EagleChainProposer(dcfg, max_draft_len=options.get("max_draft_len", 4))
        return proposer, {"net": net, "embed": model.params["embed"],
                          "lm_head": lm_head_weight(model.params)}


METHODS: dict[str, type] = {"medusa": MedusaMethod, "eagle": EagleMethod}


def make_method(name: str, **options) -> TrainMethod:
    """The method `name` with the options it knows (others are ignored)."""
    if name not in METHODS:
        raise ValueError(f"unknown training method '{name}' (available: {', '.join(METHODS)})")
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"name", "kind"}
    return cls(**{k: v for k, v in options.items() if k in fields and v is not None})
