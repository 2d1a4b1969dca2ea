"""Trainable drafting methods: what each reads, its parameters, loss, and exported checkpoint.

A method is a frozen (hashable) dataclass, so it is a static argument of the jitted train step.
It declares the features it needs (`feature_spec`), builds its trainable parameters, computes its
loss from a batch (base parameters are inputs, never trained), writes the specjax head checkpoint
that `specjax generate --heads` / the proposers load, and builds the proposer that evaluates it.
Medusa, EAGLE (EAGLE-1/2), EAGLE-3, ReDrafter and DFlash register in METHODS with the same interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import init_params as init_model_params
from specjax.model import lm_head_weight
from specjax.model_config import ModelConfig
from specjax.training import losses
from specjax.training.features import FeatureSpec, scratch_cache


class TrainMethod:
    """Interface of a trainable method (documentation; methods below implement it).

    `frozen` is {"base": the base model's parameters, **constants(...)}: inputs of the train
    step that are never differentiated (e.g. EAGLE-3's draft-vocabulary map, derived from data).
    """

    name: str  # CLI name
    kind: str  # head checkpoint kind (specjax.json "kind")
    num_outputs: int  # heads (or draft steps) reported with a top-1 accuracy each

    def feature_spec(self, config: ModelConfig, dtype: str) -> FeatureSpec: ...

    def constants(self, store, config: ModelConfig, init_heads=None) -> dict:
        """Frozen arrays the method derives from the training data (default: none)."""
        return {}

    def init_params(self, key, frozen, config: ModelConfig) -> Any: ...

    def loss(self, params, frozen, config: ModelConfig, batch: dict, key) -> tuple: ...

    def export(self, params, frozen, config: ModelConfig) -> tuple[dict, dict]:
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
    loss_positions: int | None = None  # score this many random positions per sequence
    # Cross-entropy over the `draft_ids` rows of the shared head only: what decoding drafts
    # from, at a sixth of the full vocabulary's cost per scored position.
    draft_vocab_loss: bool = False
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

    def init_params(self, key, frozen, config):
        head = lm_head_weight(frozen["base"]).astype(jnp.float32)
        variables = self._module(config).init(key, jnp.zeros((1, config.hidden_size)), head)
        if self.own_lm_head:  # start from the base's head, as Medusa does
            params = dict(variables["params"])
            for k in range(self.num_heads):
                h = dict(params[f"head_{k}"])
                h["Dense_0"] = {"kernel": head.T}
                params[f"head_{k}"] = h
            variables = {"params": params}
        return variables

    def __post_init__(self):
        if self.draft_vocab_loss and self.own_lm_head:
            raise ValueError("Medusa's draft-vocabulary loss needs the shared lm_head (own_lm_head=False)")

    def logits(self, params, base_params, config, features, rows=None):
        """Head logits [B, T, K, V] of features [B, T, D] (V: the shared head's `rows` if given)."""
        b, t, d = features.shape
        head = lm_head_weight(base_params).astype(jnp.float32)
        if rows is not None:
            head = head[rows]
        out = self._module(config).apply(params, features.reshape(b * t, d), head)
        return out.reshape(b, t, self.num_heads, -1)

    def loss(self, params, frozen, config, batch, key):
        mask = batch["mask"] & batch["valid"]
        tokens, rows = batch["tokens"], None
        if self.draft_vocab_loss:  # labels as draft-vocabulary indices; other tokens not scored
            rows = frozen["draft_ids"]
            index = (
                jnp.full((config.vocab_size,), -1, jnp.int32).at[rows].set(jnp.arange(rows.shape[0], dtype=jnp.int32))
            )
            tokens = index[tokens]
            mask = mask & (tokens >= 0)
            tokens = jnp.maximum(tokens, 0)
        feats, pos, ok = batch["final"], None, None
        if self.loss_positions:  # among positions where some head has a label
            pos, ok = losses.sample_positions(key, losses.labelled(mask, self.num_heads), self.loss_positions)
            feats = jnp.take_along_axis(feats, pos[..., None], axis=1)
        logits = self.logits(params, frozen["base"], config, feats, rows)
        return losses.medusa_loss(logits, tokens, mask, self.decay, pos, ok)

    def constants(self, store, config, init_heads=None):
        if self.own_lm_head:
            return {}
        return {"draft_ids": frequent_answer_tokens(store, config.vocab_size)}

    def export(self, params, frozen, config):
        meta = {
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "own_lm_head": self.own_lm_head,
        }
        if "draft_ids" in frozen:
            params = {**params, "draft_ids": np.asarray(frozen["draft_ids"], np.int32)}
        return params, meta

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible, load_heads

        meta, variables = load_heads(path, "medusa")
        check_compatible(meta, config, path)
        want = (self.num_heads, self.num_layers, self.own_lm_head)
        got = (int(meta["num_heads"]), int(meta["num_layers"]), bool(meta.get("own_lm_head", True)))
        if got != want:
            raise ValueError(
                f"{path} holds Medusa heads (num_heads, num_layers, own_lm_head) = {got}, the run asks for {want}"
            )
        variables = {k: v for k, v in variables.items() if k != "draft_ids"}  # from the data
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), variables)

    def proposer(self, heads_dir, model, **options):
        from specjax.methods import make_proposer

        return make_proposer("medusa", model, heads=str(heads_dir), medusa_choices=options.get("medusa_choices"))


def unroll_draft(forward, params, dcfg: ModelConfig, embed, tokens, features, valid, steps: int) -> list:
    """Draft outputs [B, T, D] of each step of the training-time test (EAGLE-3; HASS for EAGLE).

    Step 0 reads (token t + 1, feature t); step i > 0 reads (token t + 1 + i, its own step i - 1
    output at t). One paged scratch cache: step i writes its K/V at slots i*T + t with RoPE
    position t + i, and position t attends to step 0's keys at positions <= t and to its own keys
    of steps 1..i: what the draft cache holds at test time after drafting i tokens from t
    (SafeAILab's cache_hidden attention).
    """
    b, t = tokens.shape
    embed = embed.astype(jnp.float32)
    cache = scratch_cache(dcfg, b, steps * t, jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)
    causal = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [B, T, T]
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    h, outs = features, []
    for i in range(steps):
        tree_mask = jnp.concatenate([causal] + [eye] * i, axis=-1)  # [B, T, (i+1) T]
        slots = jnp.broadcast_to(i * t + pos, (b, t))
        positions = jnp.broadcast_to(pos + i, (b, t))
        h, cache = forward(
            params, dcfg, embed, losses.shift_left(tokens, 1 + i), h, positions, cache, tree_mask, valid, slots
        )
        outs.append(h)
    return outs


def grown_layers(layers: list, num_layers: int) -> list:
    """`layers` extended to `num_layers` decoder layers that start as the identity: each new
    layer copies the last one with its output projections (attention's `wo`, the MLP's `w_down`)
    zeroed, so a draft grown from trained heads first predicts exactly what they did and the
    new layers learn a correction (both residual branches add zero until trained)."""
    last = dict(layers[-1])
    last.setdefault("attn_norm", jnp.ones_like(last["mlp_norm"]))  # first layer has none
    new = dict(last, wo=jnp.zeros_like(last["wo"]), w_down=jnp.zeros_like(last["w_down"]))
    return list(layers) + [dict(new) for _ in range(num_layers - len(layers))]


@dataclasses.dataclass(frozen=True)
class EagleMethod(TrainMethod):
    """EAGLE-1 (used by EAGLE-2 too): fc([embed(t+1); f_t]) -> decoder layer(s) regress f_{t+1}.

    The target's embedding and lm_head are frozen inputs; the draft has the target's shapes with
    `num_layers` decoder layers, the first without input norm (SafeAILab/EAGLE). With `steps`
    > 1 the draft also trains on its own predicted features, as it drafts past the first token
    at test time (the training-time test of `unroll_draft`, HASS's harmonized context
    alignment): step i's feature and token losses weigh decay^i.
    """

    num_layers: int = 1
    noise_std: float = losses.EAGLE_NOISE_STD
    v_w: float = losses.EAGLE_V_W
    p_w: float = losses.EAGLE_P_W
    token_loss: str = "kl"  # or "lk": -log of the acceptance rate sum_v min(p_v, q_v)
    loss_positions: int | None = None  # score the token loss at this many random positions
    # The token loss over the `draft_ids` rows of the head only (both distributions
    # renormalised there): what decoding drafts from, a sixth of the full head's cost.
    draft_vocab_loss: bool = False
    steps: int = 1  # training-time-test steps (1: teacher-forced features only, EAGLE-1)
    decay: float = losses.EAGLE3_DECAY
    name: str = "eagle"
    kind: str = "eagle"

    @property
    def num_outputs(self) -> int:
        return self.steps

    def draft_config(self, config: ModelConfig) -> ModelConfig:
        return dataclasses.replace(config, num_layers=self.num_layers)

    def feature_spec(self, config, dtype="float16"):
        return FeatureSpec(final=True, dtype=dtype)

    def init_params(self, key, frozen, config):
        k1, k2 = jax.random.split(key)
        layers = init_model_params(self.draft_config(config), k1, jnp.float32)["layers"]
        del layers[0]["attn_norm"]
        d = config.hidden_size
        fc = {"kernel": 0.02 * jax.random.normal(k2, (2 * d, d), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}
        return {"fc": fc, "layers": layers}

    def draft(self, params, base_params, config, tokens, features, valid) -> list:
        """Predicted features [B, T, D] per step: step i at t predicts the feature of t + 1 + i
        (tokens [B, T]: the sequence; features: the target's feature of t, step 0's input)."""
        from specjax.proposers.eagle_net import eagle_forward

        return unroll_draft(
            eagle_forward, params, self.draft_config(config), base_params["embed"], tokens, features, valid, self.steps
        )

    def loss(self, params, frozen, config, batch, key):
        base_params = frozen["base"]
        valid = batch["valid"]
        _, feats, _, mask = losses.eagle_shift(batch["tokens"], batch["final"], batch["mask"], valid)
        if self.noise_std > 0:
            lengths = jnp.sum(valid, axis=1)
            noisy = losses.uniform_feature_noise(key, feats, lengths, self.noise_std)
            feats = jnp.where(valid[..., None], noisy, feats)
        preds = self.draft(params, base_params, config, batch["tokens"], feats, valid)
        head = lm_head_weight(base_params).astype(jnp.float32)
        if self.draft_vocab_loss:
            head = head[frozen["draft_ids"]]
        total, steps = 0.0, []
        for i, pred in enumerate(preds):
            m = losses.shift_left(mask, i) & valid  # f_{t+1+i} exists and t + i is scored
            pos = ok = None
            if self.loss_positions:
                pos, ok = losses.sample_positions(jax.random.fold_in(key, 1 + i), m, self.loss_positions)
            step_loss, metrics = losses.eagle_loss(
                pred, losses.shift_left(batch["final"], 1 + i), head, m, self.v_w, self.p_w, pos, ok, self.token_loss
            )
            total = total + self.decay**i * step_loss
            steps.append((step_loss, metrics))
        if len(steps) == 1:
            return steps[0]
        metrics = dict(steps[0][1])  # feature and token terms of step 0 (teacher-forced)
        metrics["loss_k"] = jnp.stack([s[0] for s in steps])
        metrics["acc_k"] = jnp.concatenate([s[1]["acc_k"] for s in steps])
        return total, metrics

    def constants(self, store, config, init_heads=None):
        return {"draft_ids": frequent_answer_tokens(store, config.vocab_size)}

    def export(self, params, frozen, config):
        variables = {"fc": params["fc"], "layers": {str(i): layer for i, layer in enumerate(params["layers"])}}
        if "draft_ids" in frozen:
            variables["draft_ids"] = np.asarray(frozen["draft_ids"], np.int32)
        meta = {
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "config": self.draft_config(config).to_hf(),
        }
        return variables, meta

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible, load_heads
        from specjax.proposers.eagle_net import load_eagle_heads

        meta, _ = load_heads(path, "eagle")
        check_compatible(meta, config, path)
        dcfg, params = load_eagle_heads(path)
        params.pop("draft_ids", None)  # recomputed from the data (constants)
        if dcfg.num_layers > self.num_layers:
            raise ValueError(
                f"{path} holds an EAGLE draft of {dcfg.num_layers} layers, the run asks for {self.num_layers}"
            )
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
        params["layers"] = grown_layers(params["layers"], self.num_layers)
        return params

    def proposer(self, heads_dir, model, **options):
        from specjax.heads import check_compatible, load_heads
        from specjax.proposers.eagle import EagleChainProposer
        from specjax.proposers.eagle_net import load_eagle_heads

        meta, _ = load_heads(heads_dir, "eagle")
        check_compatible(meta, model.config, heads_dir)
        dcfg, net = load_eagle_heads(heads_dir)
        ids = net.pop("draft_ids", None)
        dtype = model.params["embed"].dtype
        net = jax.tree_util.tree_map(lambda a: a.astype(dtype), net)
        proposer = EagleChainProposer(dcfg, max_draft_len=options.get("max_draft_len", 4))
        pparams = {"net": net, "embed": model.params["embed"], "lm_head": lm_head_weight(model.params)}
        if ids is not None:  # draft from the rows of the tokens seen in training
            from specjax.proposers.eagle_net import draft_vocabulary

            pparams["lm_head"], pparams["draft_ids"] = draft_vocabulary(pparams["lm_head"], ids, None)
        # packed once for the CPU kernel (float32 kept: the heads draft as trained), not per call
        from specjax.cpu.draft_weights import draft_weights, use_draft_weights

        with use_draft_weights("float32"):
            packed = draft_weights({"layers": net["layers"], "lm_head": pparams["lm_head"]})
        pparams["net"] = {**net, "layers": packed["layers"]}
        pparams["lm_head"] = packed["lm_head"]
        return proposer, pparams


# Most frequent answer tokens an EAGLE-1/2 or Medusa head records for frequency-ranked drafting.
DRAFT_VOCAB_CAP = 8192


def frequent_answer_tokens(store, vocab_size: int, cap: int = DRAFT_VOCAB_CAP):
    """The answer tokens seen in training, most frequent first (at most `cap`): exported as
    `draft_ids` so decoding can draft from those lm_head rows only (FR-Spec)."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(len(store)):
        s = store.sequence(i)
        np.add.at(counts, np.asarray(s["tokens"])[np.asarray(s["mask"])], 1)
    seen = int(np.count_nonzero(counts))
    # Never fewer than 64 rows (trees take up to top-k ranks): unseen tokens fill up, by id.
    n = min(vocab_size, max(64, min(seen, cap)))
    ids = np.argsort(-counts, kind="stable")[:n]
    return jnp.asarray(ids.astype(np.int32))


@dataclasses.dataclass(frozen=True)
class Eagle3Method(TrainMethod):
    """EAGLE-3: fc(three target layers) -> one decoder layer over [embedding; feature], its own
    norm and reduced-vocabulary lm_head, trained with the training-time test (the draft unrolled
    `steps` times on its own outputs, losses weighted decay^i).

    The unroll (`unroll_draft`) runs the inference network (`eagle3_forward`). The draft
    vocabulary is the `draft_vocab_size` most frequent answer tokens of the training data (its
    d2t map is a frozen constant); the draft lm_head starts from the target's rows.
    """

    steps: int = losses.EAGLE3_STEPS
    decay: float = losses.EAGLE3_DECAY
    draft_vocab_size: int = 8192
    name: str = "eagle3"
    kind: str = "eagle3"

    @property
    def num_outputs(self) -> int:
        return self.steps

    def feature_layers(self, config: ModelConfig) -> tuple[int, ...]:
        from specjax.proposers.eagle3_net import eagle3_feature_layers

        return eagle3_feature_layers(config.num_layers)

    def feature_spec(self, config, dtype="float16"):
        layers = tuple(sorted(set(self.feature_layers(config))))  # tiny targets repeat layers
        return FeatureSpec(final=True, layers=layers, dtype=dtype)

    def _vocab(self, config) -> int:
        return min(self.draft_vocab_size, config.vocab_size)

    def constants(self, store, config, init_heads=None):
        from specjax.proposers.eagle3_net import d2t_from_counts, load_eagle3_heads

        if init_heads is not None:
            _, params, _ = load_eagle3_heads(init_heads)
            d2t = np.asarray(params["d2t"], np.int32)
        else:
            counts = np.zeros(config.vocab_size, np.int64)
            for i in range(len(store)):
                s = store.sequence(i)
                np.add.at(counts, np.asarray(s["tokens"])[np.asarray(s["mask"])], 1)
            d2t = d2t_from_counts(counts, config.vocab_size, self._vocab(config))
        kept = np.arange(len(d2t)) + d2t
        return {
            "d2t": jnp.asarray(d2t),
            "kept": jnp.asarray(kept, jnp.int32),
            "t2d": jnp.asarray(np.isin(np.arange(config.vocab_size), kept)),
        }

    def init_params(self, key, frozen, config):
        from specjax.proposers.eagle3_net import init_eagle3_params

        _, params = init_eagle3_params(key, config, self._vocab(config))
        del params["d2t"]
        head = lm_head_weight(frozen["base"]).astype(jnp.float32)
        params["lm_head"] = head[frozen["kept"]]
        return params

    def unroll(self, params, frozen, config, batch):
        """Draft log-probabilities [K, B, T, N] of the training-time test over a batch."""
        from specjax.proposers.eagle3_net import draft_config, eagle3_forward, eagle3_fuse, eagle3_logprobs

        dcfg = draft_config(config)
        feats = jnp.concatenate([batch[f"layer_{i}"] for i in self.feature_layers(config)], -1)
        outs = unroll_draft(
            eagle3_forward,
            params,
            dcfg,
            frozen["base"]["embed"],
            batch["tokens"],
            eagle3_fuse(params, feats),
            batch["valid"],
            self.steps,
        )
        return jnp.stack([eagle3_logprobs(params, dcfg, x) for x in outs])

    def loss(self, params, frozen, config, batch, key):
        head = lm_head_weight(frozen["base"]).astype(jnp.float32)
        final = batch["final"]
        full = jnp.einsum("btd,vd->btv", final, head, preferred_element_type=jnp.float32)
        in_vocab = frozen["t2d"][jnp.argmax(full, -1)]
        target = jnp.take(full, frozen["kept"], axis=-1)
        logp = self.unroll(params, frozen, config, batch)
        return losses.eagle3_loss(logp, target, in_vocab, batch["mask"] & batch["valid"], batch["valid"], self.decay)

    def export(self, params, frozen, config):
        from specjax.proposers.eagle3_net import draft_config

        variables = {k: v for k, v in params.items() if k != "layers"}
        variables["layers"] = {str(i): layer for i, layer in enumerate(params["layers"])}
        variables["d2t"] = np.asarray(frozen["d2t"], np.int32)
        meta = {
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "feature_layers": list(self.feature_layers(config)),
            "draft_vocab_size": int(params["lm_head"].shape[0]),
            "config": draft_config(config).to_hf(),
        }
        return variables, meta

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible
        from specjax.proposers.eagle3_net import load_eagle3_heads

        _, params, meta = load_eagle3_heads(path)
        check_compatible(meta, config, path)
        params = {k: v for k, v in params.items() if k != "d2t"}
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)

    def proposer(self, heads_dir, model, **options):
        from specjax.methods import make_proposer

        return make_proposer("eagle3", model, heads=str(heads_dir))


@dataclasses.dataclass(frozen=True)
class ReDrafterMethod(TrainMethod):
    """ReDrafter: an RNN over the next tokens' embeddings plus ResBlocks and a vocabulary head on
    [h_t; s_i]; step i predicts token t + i + 2 (Apple's recurrent drafter training).

    draft_vocab_size: project onto the most frequent answer tokens only (`draft_ids`, most
    frequent first); labels outside that vocabulary are not scored.
    """

    steps: int = 5
    num_layers: int = 1  # ResBlocks of the drafter head (num_draft_layers)
    rnn: bool = True
    loss_positions: int | None = None  # score this many random positions per sequence
    draft_vocab_size: int | None = None
    name: str = "redrafter"
    kind: str = "redrafter"

    @property
    def num_outputs(self) -> int:
        return self.steps

    def feature_spec(self, config, dtype="float16"):
        return FeatureSpec(final=True, dtype=dtype)

    def _reduced(self, config) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < config.vocab_size

    def constants(self, store, config, init_heads=None):
        if not self._reduced(config):
            return {}
        if init_heads is not None:
            from specjax.proposers.redrafter import load_redrafter

            ids = np.asarray(load_redrafter(init_heads)[1]["draft_ids"], np.int32)
        else:
            counts = np.zeros(config.vocab_size, np.int64)
            for i in range(len(store)):
                s = store.sequence(i)
                np.add.at(counts, np.asarray(s["tokens"])[np.asarray(s["mask"])], 1)
            ids = np.argsort(-counts, kind="stable")[: self.draft_vocab_size].astype(np.int32)
        t2d = np.full(config.vocab_size, -1, np.int32)
        t2d[ids] = np.arange(len(ids), dtype=np.int32)
        return {"draft_ids": jnp.asarray(ids), "t2d": jnp.asarray(t2d)}

    def init_params(self, key, frozen, config):
        from specjax.proposers.redrafter import init_params

        vocab = len(frozen["draft_ids"]) if "draft_ids" in frozen else config.vocab_size
        return init_params(key, config.hidden_size, vocab, num_draft_layers=self.num_layers, rnn=self.rnn)

    def logits(self, params, frozen, batch, positions=None):
        """Drafter logits [B, P, K, V] at positions [B, P] (default all): step i reads
        [h_t; s_{i+1}], the state built from e(x_{t+1}) .. e(x_{t+i+1}) (zeros past the end)."""
        from specjax.proposers.redrafter import drafter_logits, rnn_step

        tokens, h = batch["tokens"], batch["final"]
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        h = jnp.take_along_axis(h, positions[..., None], axis=1)
        embed = frozen["base"]["embed"].astype(jnp.float32)
        state = jnp.zeros_like(h)
        out = []
        for i in range(self.steps):
            at = positions + 1 + i
            tok = jnp.take_along_axis(tokens, jnp.minimum(at, t - 1), axis=1)
            emb = jnp.where((at < t)[..., None], embed[tok], 0.0)
            state = rnn_step(params, state, emb, self.rnn)
            out.append(drafter_logits(params, h, state))
        return jnp.stack(out, axis=2)

    def loss(self, params, frozen, config, batch, key):
        mask = batch["mask"] & batch["valid"]
        labels = batch["tokens"]
        if "t2d" in frozen:  # draft-vocabulary labels; tokens outside it are not scored
            labels = frozen["t2d"][labels]
            mask = mask & (labels >= 0)
            labels = jnp.maximum(labels, 0)
        pos = ok = None
        if self.loss_positions:  # among positions where some step has a label
            pos, ok = losses.sample_positions(key, losses.labelled(mask, self.steps), self.loss_positions)
        return losses.redrafter_loss(self.logits(params, frozen, batch, pos), labels, mask, pos, ok)

    def export(self, params, frozen, config):
        meta = {
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "exit_dim": 2 * config.hidden_size,
            "num_draft_layers": self.num_layers,
            "rnn": self.rnn,
        }
        if "draft_ids" in frozen:
            params = {**params, "draft_ids": np.asarray(frozen["draft_ids"], np.int32)}
            meta["draft_vocab_size"] = int(len(frozen["draft_ids"]))
        return params, meta

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible
        from specjax.proposers.redrafter import load_redrafter

        meta, params = load_redrafter(path)
        check_compatible(meta, config, path)
        want_vocab = self.draft_vocab_size if self._reduced(config) else config.vocab_size
        if (meta["num_draft_layers"], meta["rnn"], meta["exit_dim"], meta["draft_vocab_size"]) != (
            self.num_layers,
            self.rnn,
            2 * config.hidden_size,
            want_vocab,
        ):
            raise ValueError(f"{path} holds a ReDrafter of another shape than the run asks for")
        params = {k: v for k, v in params.items() if k != "draft_ids"}
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)

    def proposer(self, heads_dir, model, **options):
        from specjax.proposers.redrafter import make_redrafter

        return make_redrafter(model, str(heads_dir))


@dataclasses.dataclass(frozen=True)
class DFlashMethod(TrainMethod):
    """DFlash: a block drafter of `num_layers` non-causal layers drafts the K - 1 tokens after a
    pending token in one pass, from the target's features of the tokens before it
    (`specjax.proposers.dflash_net`).

    Each step samples `loss_positions` anchors per sequence among the answer tokens (each with
    an answer token after it); anchor a's block [token a, mask x (K - 1)] sits at positions
    a .. a + K - 1 and sees the fused features of positions < a, as at inference, where the
    context holds every token before the pending one. All blocks of a batch run in one dense
    pass (`dflash_blocks`, the inference layers with a mask in place of the paged cache); slot j
    is scored on the distilled answer's token a + j (the target's greedy choice when the answers
    are greedy) with weights exp(-(j - 1) / gamma) (`losses.dflash_loss`).

    As in the reference the draft layers and `fc` start random and the target's embedding and
    LM head are frozen inputs. The mask token is `mask_token_id`, else the highest vocabulary id
    the training sequences never hold (`constants`): the reference adds a fresh <|MASK|> token,
    a target without a spare row lends one its data does not use.
    """

    num_layers: int = 1
    block_size: int = 16
    loss_positions: int = 32  # anchors (blocks) per sequence and step
    loss_decay_gamma: float | None = None  # None: the paper's for the block size
    mask_token_id: int | None = None
    name: str = "dflash"
    kind: str = "dflash"

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"a DFlash block holds the anchor and drafts: block_size >= 2, got {self.block_size}")

    @property
    def num_outputs(self) -> int:
        return self.block_size - 1

    @property
    def gamma(self) -> float:
        if self.loss_decay_gamma is None:
            return losses.dflash_decay_gamma(self.block_size)
        return self.loss_decay_gamma

    def target_layers(self, config: ModelConfig) -> tuple[int, ...]:
        from specjax.proposers.dflash_net import default_target_layers

        return default_target_layers(config.num_layers, self.num_layers)

    def draft_config(self, config: ModelConfig) -> ModelConfig:
        from specjax.proposers.dflash_net import draft_config

        return draft_config(config, self.num_layers)

    def feature_spec(self, config, dtype="float16"):
        return FeatureSpec(final=False, layers=tuple(sorted(set(self.target_layers(config)))), dtype=dtype)

    def constants(self, store, config, init_heads=None):
        if self.mask_token_id is not None:
            mask = self.mask_token_id
        elif init_heads is not None:
            from specjax.proposers.dflash_net import load_dflash_heads

            mask = int(load_dflash_heads(init_heads)[2]["mask_token_id"])
        else:
            seen = np.zeros(config.vocab_size, bool)
            for i in range(len(store)):
                seen[np.asarray(store.sequence(i)["tokens"])] = True
            unused = np.flatnonzero(~seen)
            mask = int(unused[-1]) if len(unused) else config.vocab_size - 1
        if not 0 <= mask < config.vocab_size:
            raise ValueError(f"mask_token_id {mask} is outside the vocabulary of {config.vocab_size}")
        return {"mask_token_id": jnp.asarray(mask, jnp.int32)}

    def init_params(self, key, frozen, config):
        from specjax.proposers.dflash_net import init_dflash_params

        layers = self.target_layers(config)
        return init_dflash_params(key, self.draft_config(config), len(layers), config.hidden_size)

    def loss(self, params, frozen, config, batch, key):
        from specjax.proposers.dflash_net import dflash_blocks, dflash_fuse, dflash_logits

        dcfg, base, k = self.draft_config(config), frozen["base"], self.block_size
        tokens, answer = batch["tokens"], batch["mask"] & batch["valid"]
        b, t = tokens.shape
        anchors, ok = losses.sample_positions(key, answer & losses.shift_left(answer, 1), self.loss_positions)
        n = anchors.shape[1]
        at = anchors[..., None] + jnp.arange(k, dtype=jnp.int32)  # [B, N, K]
        flat = jnp.minimum(at, t - 1).reshape(b, n * k)
        labels = jnp.take_along_axis(tokens, flat, axis=1).reshape(b, n, k)
        scored = (at < t) & jnp.take_along_axis(answer, flat, axis=1).reshape(b, n, k) & ok[..., None]
        blocks = jnp.where(jnp.arange(k) == 0, labels, frozen["mask_token_id"])
        feats = jnp.concatenate([batch[f"layer_{i}"] for i in self.target_layers(config)], -1)
        context = dflash_fuse(params, dcfg, feats)
        hidden = dflash_blocks(params, dcfg, base["embed"].astype(jnp.float32), context, blocks, anchors)
        logits = dflash_logits(lm_head_weight(base).astype(jnp.float32), hidden[:, :, 1:])
        return losses.dflash_loss(logits, labels[..., 1:], scored[..., 1:], self.gamma)

    def export(self, params, frozen, config):
        from specjax.proposers.dflash_net import dflash_head_variables

        meta = {
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "target_layers": list(self.target_layers(config)),
            "block_size": self.block_size,
            "mask_token_id": int(frozen["mask_token_id"]),
        }
        return dflash_head_variables(self.draft_config(config), params, meta)

    def params_from_heads(self, path, config):
        from specjax.heads import check_compatible
        from specjax.proposers.dflash_net import load_dflash_heads

        dcfg, net, meta = load_dflash_heads(path)
        check_compatible(meta, config, path)
        got = (dcfg.num_layers, tuple(meta["target_layers"]), int(meta["block_size"]))
        want = (self.num_layers, self.target_layers(config), self.block_size)
        if got != want:
            raise ValueError(
                f"{path} holds a DFlash drafter of (layers, target layers, block size) = {got}, the run asks for {want}"
            )
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), net)

    def proposer(self, heads_dir, model, **options):
        from specjax.methods import make_proposer

        return make_proposer("dflash", model, heads=str(heads_dir))


METHODS: dict[str, type] = {
    "medusa": MedusaMethod,
    "eagle": EagleMethod,
    "eagle3": Eagle3Method,
    "redrafter": ReDrafterMethod,
    "dflash": DFlashMethod,
}


def make_method(name: str, **options) -> TrainMethod:
    """The method `name` with `options` (None means the method's default).

    An option the method does not have is refused rather than ignored: `--num-heads` on an EAGLE
    run, or `draft_steps=` for `steps=`, would otherwise train something other than asked for.
    """
    fields = method_options(name)
    unknown = sorted(k for k, v in options.items() if k not in fields and v is not None)
    if unknown:
        raise ValueError(
            f"training method '{name}' has no option {', '.join(unknown)} (its options: {', '.join(sorted(fields))})"
        )
    return METHODS[name](**{k: v for k, v in options.items() if v is not None})


def method_options(name: str) -> set[str]:
    """The options training method `name` takes."""
    if name not in METHODS:
        raise ValueError(f"unknown training method '{name}' (available: {', '.join(METHODS)})")
    return {f.name for f in dataclasses.fields(METHODS[name])} - {"name", "kind"}
