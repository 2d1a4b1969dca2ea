"""Training: a jitted pure train step, resumable orbax checkpoints, and the whole pipeline.

`train_step(method, config, opt, state, frozen, batch, key)` is pure: the base model's
parameters (in `frozen`) are an input that is never differentiated. The data order is a function of
(seed, step) alone (a seeded permutation per epoch) and so is the noise key, so a run killed
after a checkpoint resumes with the same batches and reaches the same state as an
uninterrupted run. `run(TrainConfig)` chains self-distillation, features, training, export and
evaluation, each resumable and cached in the output (and data) folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.model_config import ModelConfig
from specjax.training.features import FeatureStore
from specjax.training.trainers import TrainMethod

RUN_FILE = "train.json"
METRICS_FILE = "metrics.jsonl"
CKPT_DIR = "checkpoints"
HEADS_DIR = "heads"
PLOT_FILE = "loss.png"


class TrainError(ValueError):
    """A run that cannot start or resume (one-line message)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, after global-norm clipping (hashable)."""

    lr: float = 1e-3
    steps: int = 1000
    warmup: int = 50
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95  # SafeAILab/EAGLE's betas


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.end_lr_ratio
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip), optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    )


@struct.dataclass
class TrainState:
    """Everything a resumed run needs (the data position is `step`)."""

    step: jax.Array  # int32 scalar: steps taken
    params: Any
    opt_state: Any


def init_state(method: TrainMethod, opt: OptimConfig, params) -> TrainState:
    # Own copies: a leaf shared by two parameters (e.g. one `ones` for several norms) could not
    # be donated twice to the train step.
    params = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), params)
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(opt).init(params))


@functools.partial(jax.jit, static_argnames=("method", "config", "opt"), donate_argnames=("state",))
def train_step(method: TrainMethod, config: ModelConfig, opt: OptimConfig, state: TrainState, frozen, batch: dict, key):
    """One optimizer step on `batch`; returns (state, metrics incl. loss and grad norm).

    frozen: {"base": base model parameters, **method constants}, never differentiated.
    """

    def loss_fn(p):
        return method.loss(p, frozen, config, batch, key)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = make_optimizer(opt).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": _tree_norm(grads), **metrics}
    return TrainState(state.step + 1, params, opt_state), metrics


_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def batch_ids(step: int, batch_size: int, n: int, seed: int, lengths: np.ndarray | None = None) -> np.ndarray:
    """Sequence ids of batch `step`: a seeded permutation of all n sequences per epoch.

    With `lengths` (tokens per sequence) batches hold sequences of similar length, as Hugging
    Face's `group_by_length` does: less padding, so a step over short sequences costs less.
    """
    if lengths is not None and n >= 2 * batch_size:
        per_epoch = n // batch_size  # whole batches; the n % batch_size left over vary by epoch
        epoch, j = divmod(step, per_epoch)
        return _length_grouped_order(epoch, batch_size, lengths, seed)[j]
    pos = step * batch_size + np.arange(batch_size)
    epochs = pos // n
    out = np.empty(batch_size, np.int64)
    for e in np.unique(epochs):
        perm = np.random.default_rng([seed, int(e)]).permutation(n)
        sel = epochs == e
        out[sel] = perm[pos[sel] % n]
    return out


LENGTH_GROUP_BATCHES = 50  # batches per length-sorted window (Hugging Face's mega-batch)


def _length_grouped_order(epoch: int, batch_size: int, lengths: np.ndarray, seed: int) -> np.ndarray:
    """int[n // batch_size, batch_size]: one epoch's batches of similar length, in seeded order.

    The epoch's permutation is cut into windows of LENGTH_GROUP_BATCHES batches, each window
    sorted by length, split into batches, and the batches shuffled.
    """
    n = len(lengths)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    window = LENGTH_GROUP_BATCHES * batch_size
    parts = [w[np.argsort(-lengths[w], kind="stable")] for w in np.split(perm, range(window, n, window))]
    per_epoch = n // batch_size
    batches = np.concatenate(parts)[: per_epoch * batch_size].reshape(per_epoch, batch_size)
    return batches[np.random.default_rng([seed, epoch, 1]).permutation(per_epoch)]


def step_key(seed: int, step: int):
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


class Sharder:
    """Puts batches on a `data` mesh axis (and replicates the rest) when several devices exist."""

    def __init__(self, batch_size: int, devices=None):
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        devices = list(jax.devices() if devices is None else devices)
        self.mesh = None
        if len(devices) > 1:
            if batch_size % len(devices):
                raise TrainError(f"batch size {batch_size} is not a multiple of the {len(devices)} devices")
            self.mesh = Mesh(np.asarray(devices), ("data",))
            self.data = NamedSharding(self.mesh, P("data"))
            self.replicated = NamedSharding(self.mesh, P())

    def batch(self, batch: dict) -> dict:
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return {k: jax.device_put(v, self.data) for k, v in batch.items()}

    def replicate(self, tree):
        if self.mesh is None:
            return tree
        return jax.device_put(tree, self.replicated)


def _checkpoint_manager(path: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        path.absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False),
    )


def save_checkpoint(mngr, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    mngr.save(int(state.step), args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()


def restore_checkpoint(mngr, like: TrainState) -> TrainState | None:
    """The latest checkpoint (None if there is none), restored into `like`'s structure."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    return mngr.restore(step, args=ocp.args.StandardRestore(abstract))


def fit(
    method: TrainMethod,
    config: ModelConfig,
    base_params,
    store: FeatureStore,
    out_dir,
    opt: OptimConfig,
    *,
    batch_size: int,
    max_len: int,
    seed: int,
    save_every: int,
    init_params=None,
    stop_after: int | None = None,
    progress: bool = True,
    devices=None,
    constants: dict | None = None,
    group_by_length: bool = False,
) -> TrainState:
    """Train `method` on `store` for opt.steps steps, checkpointing under out_dir; resumable.

    stop_after: stop (with a checkpoint) once this many steps are done, as a killed run would;
    a later call continues to opt.steps. devices: the batch is split over these (default all).
    constants: the method's frozen data-derived arrays (default: method.constants(store)).
    group_by_length: batches of sequences of similar length (batch_ids).
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if store.hidden_size != config.hidden_size:
        raise TrainError(
            f"features of hidden size {store.hidden_size} do not fit the base model's {config.hidden_size}"
        )
    sharder = Sharder(batch_size, devices)
    if constants is None:
        constants = method.constants(store, config)
    frozen = {"base": base_params, **constants}
    params = method.init_params(jax.random.PRNGKey(seed), frozen, config) if init_params is None else init_params
    state = init_state(method, opt, params)
    mngr = _checkpoint_manager(out_dir / CKPT_DIR)
    restored = restore_checkpoint(mngr, state)
    if restored is not None:
        state = restored
    start = int(state.step)
    _trim_metrics(out_dir / METRICS_FILE, start)
    state = sharder.replicate(state)
    frozen = sharder.replicate(frozen)
    end = opt.steps if stop_after is None else min(opt.steps, stop_after)
    lengths = np.minimum(store.lengths, max_len) if group_by_length else None
    bar = tqdm(
        total=opt.steps,
        initial=start,
        disable=not progress,
        desc=f"train {method.name}",
        unit="step",
        dynamic_ncols=True,
    )
    with open(out_dir / METRICS_FILE, "a") as log:
        for step in range(start, end):
            ids = batch_ids(step, batch_size, len(store), seed, lengths)
            batch = store.batch(ids, max_len)
            state, metrics = train_step(method, config, opt, state, frozen, sharder.batch(batch), step_key(seed, step))
            m = jax.device_get(metrics)
            row = {
                "step": step + 1,
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "acc": [float(a) for a in np.atleast_1d(m["acc_k"])],
            }
            for k in ("vloss", "ploss", "kl", "alpha", "accepted"):
                if k in m:
                    row[k] = float(m[k])
            if "loss_k" in m:
                row["loss_k"] = [float(a) for a in m["loss_k"]]
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix_str(f"loss {row['loss']:.3f} acc " + " ".join(f"{a:.2f}" for a in row["acc"]))
            if (step + 1) % save_every == 0 or step + 1 == end:
                save_checkpoint(mngr, state)
    if int(state.step) == end and mngr.latest_step() != end:
        save_checkpoint(mngr, state)
    bar.close()
    mngr.close()
    return state


def _trim_metrics(path: Path, step: int) -> None:
    """Drop logged steps past the checkpoint a run resumes from."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            break
    path.write_text("".join(l + "\n" for l in keep))


def plot_metrics(out_dir, title: str = "") -> Path | None:
    """loss.png: training loss (and smoothed) and top-1 accuracy per head against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    rows = [json.loads(l) for l in (out_dir / METRICS_FILE).read_text().splitlines() if l]
    if not rows:
        return None
    steps = np.asarray([r["step"] for r in rows])
    loss = np.asarray([r["loss"] for r in rows])
    acc = np.asarray([r["acc"] for r in rows])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(steps, loss, alpha=0.35, label="loss")
    w = max(1, len(loss) // 50)
    if w > 1:
        a1.plot(steps[w - 1 :], np.convolve(loss, np.ones(w) / w, "valid"), label=f"mean of {w}")
    a1.set_xlabel("step")
    a1.set_ylabel("loss")
    a1.legend()
    for k in range(acc.shape[1]):
        a = acc[:, k]
        a = np.convolve(a, np.ones(w) / w, "valid") if w > 1 else a
        a2.plot(steps[len(steps) - len(a) :], a, label=f"head {k}")
    a2.set_xlabel("step")
    a2.set_ylabel("top-1 accuracy")
    a2.set_ylim(0, 1)
    a2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The whole pipeline


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """All settings of `specjax train`; saved to out/train.json (a resumed run must match)."""

    method: str
    base: str
    prompts: str
    out: str
    data: str | None = None  # data folder (distillation + features); default out/data
    max_prompts: int | None = 1000
    max_prompt_tokens: int = 512
    max_new_tokens: int = 160
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    distill_batch: int = 16
    feature_batch: int = 8
    feature_dtype: str = "float16"
    max_len: int = 512
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    group_by_length: bool = False
    method_options: tuple = ()  # sorted (name, value) pairs, e.g. (("num_heads", 4),)
    init_heads: str | None = None
    eval_prompts: int = 20
    eval_max_new_tokens: int = 64
    until: str = "evaluate"  # last stage: distill, features, train or evaluate
    only_distilled: bool = False  # train on the selected prompts already answered, answer none
    extra_data: tuple = ()  # other data folders whose features are trained on as well

    def optim(self) -> OptimConfig:
        return OptimConfig(
            lr=self.lr, steps=self.steps, warmup=self.warmup, weight_decay=self.weight_decay, clip=self.clip
        )

    @property
    def data_dir(self) -> Path:
        return Path(self.data) if self.data else Path(self.out) / "data"


STAGES = ("distill", "features", "train", "evaluate")
# Settings that may differ when a run resumes (they do not change the trained state).
_RESUMABLE = {"out", "until", "eval_prompts", "eval_max_new_tokens", "distill_batch", "feature_batch"}


def check_out_dir(cfg: TrainConfig, hidden_size: int, vocab_size: int) -> None:
    """Refuse an output folder holding another method's run or heads, or another base's."""
    from specjax.checkpoint import FORMAT_FILE

    out = Path(cfg.out)
    run_file = out / RUN_FILE
    if run_file.exists():
        old = json.loads(run_file.read_text())
        if old.get("method") != cfg.method:
            raise TrainError(
                f"output folder {out} holds a {old.get('method')} training run, not {cfg.method}: use another --out"
            )
        if old.get("hidden_size") != hidden_size or old.get("vocab_size") != vocab_size:
            raise TrainError(
                f"output folder {out} holds heads for hidden_size "
                f"{old.get('hidden_size')} / vocab_size {old.get('vocab_size')}; the "
                f"base model has hidden_size {hidden_size} / vocab_size {vocab_size}"
            )
        new = _as_json(dataclasses.asdict(cfg))
        defaults = _as_json(
            {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
        )
        for k, v in new.items():
            # a setting newer than the run's file had its default there
            was = old["config"].get(k, defaults.get(k))
            if k not in _RESUMABLE and was != v:
                raise TrainError(
                    f"output folder {out} holds a run with {k}={was!r}, "
                    f"not {v!r}: use another --out (or the same settings to resume)"
                )
    heads = out / HEADS_DIR / FORMAT_FILE
    if heads.exists():
        kind = json.loads(heads.read_text()).get("kind")
        if kind != _method_kind(cfg.method):
            raise TrainError(f"output folder {out} holds {kind} heads, not {cfg.method}: use another --out")
    if not run_file.exists() and (out / CKPT_DIR).exists():
        raise TrainError(f"output folder {out} holds checkpoints of an unknown run (no {RUN_FILE}): use another --out")


def _method_kind(name: str) -> str:
    from specjax.training.trainers import METHODS

    return METHODS[name].kind if name in METHODS else name


def _write_run_file(cfg: TrainConfig, hidden_size: int, vocab_size: int) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(
        json.dumps(
            {
                "method": cfg.method,
                "hidden_size": hidden_size,
                "vocab_size": vocab_size,
                "config": dataclasses.asdict(cfg),
            },
            indent=2,
        )
    )


def _as_json(d: dict) -> dict:
    """d as the run file stores it (tuples become lists), so settings compare equal."""
    return json.loads(json.dumps(d))


def select_prompts(cfg: TrainConfig, records, tokenizer):
    """(train indices, held-out eval indices): round-robin over categories, short prompts only."""
    from specjax.training.data import encode_record, spread_over_categories

    lengths: dict[int, int] = {}

    def fits(i):
        if records[i].is_text:
            return True
        lengths[i] = len(encode_record(tokenizer, records[i]))
        return lengths[i] <= cfg.max_prompt_tokens

    train = spread_over_categories(records, cfg.max_prompts, fits)
    taken = set(train)
    rest = [i for i in range(len(records)) if i not in taken]
    sub = [records[i] for i in rest]
    held = spread_over_categories(sub, cfg.eval_prompts, lambda j: sub[j].is_text or fits(rest[j]))
    return train, [rest[j] for j in held]


def training_store(root: Path, extra_data: Sequence[str], data_dir: Path) -> FeatureStore:
    """The features of this run's data folder, followed by those of the same spec in extra_data."""
    from specjax.training.features import FEATURES_DIR, FeatureStores

    store = FeatureStore(root)
    if not extra_data:
        return store
    parts = [store]
    for d in extra_data:
        if Path(d).resolve() == Path(data_dir).resolve():
            raise TrainError(f"--extra-data {d} is the run's own data folder")
        sub = Path(d) / FEATURES_DIR / root.name
        if not (sub / "meta.json").exists():
            raise TrainError(
                f"--extra-data {d} has no {root.name} features: extract them with --data {d} --until features first"
            )
        try:
            parts.append(FeatureStore(sub))
        except ValueError as e:
            raise TrainError(f"--extra-data {d}: {e}") from None
    try:
        return FeatureStores(parts)
    except ValueError as e:
        raise TrainError(str(e)) from None


def run(cfg: TrainConfig, *, stop_after: int | None = None, progress: bool = True, model=None) -> dict:
    """The whole pipeline up to cfg.until; returns paths and results of the stages run."""
    from specjax.cpu.matmul import unpack_params
    from specjax.heads import save_heads
    from specjax.loading import load_model
    from specjax.training.data import DistillConfig, distill, read_prompt_file, sequences_of
    from specjax.training.features import extract_features
    from specjax.training.trainers import make_method

    if cfg.until not in STAGES:
        raise TrainError(f"unknown stage '{cfg.until}' (stages: {', '.join(STAGES)})")
    method = make_method(cfg.method, **dict(cfg.method_options))
    records = read_prompt_file(cfg.prompts)
    model = load_model(cfg.base, dtype=jnp.float32) if model is None else model
    config = model.config
    # answers and evaluation decode with the weights packed for the CPU kernel; features and
    # training read plain ones
    plain_params = unpack_params(model.params)
    check_out_dir(cfg, config.hidden_size, config.vocab_size)
    init_params = None
    if cfg.init_heads:
        init_params = method.params_from_heads(cfg.init_heads, config)
    _write_run_file(cfg, config.hidden_size, config.vocab_size)
    result: dict = {"out": cfg.out}
    train_idx, eval_idx = select_prompts(cfg, records, model.tokenizer)
    if cfg.only_distilled:
        from specjax.training.data import distilled_indices

        done = distilled_indices(cfg.data_dir)
        train_idx = [i for i in train_idx if i in done]
        if not train_idx:
            raise TrainError(f"--only-distilled: no selected prompt is answered in {cfg.data_dir}")
    dcfg = DistillConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed, cfg.distill_batch)
    t0 = time.perf_counter()
    rows = distill(
        model, records, train_idx, cfg.data_dir, dcfg, max_prompt_tokens=cfg.max_prompt_tokens, progress=progress
    )
    result["distill_seconds"] = time.perf_counter() - t0
    result["sequences"] = len(rows)
    if cfg.until == "distill":
        return result
    spec = method.feature_spec(config, cfg.feature_dtype)
    root = extract_features(
        plain_params,
        config,
        sequences_of(rows, cfg.max_len),
        cfg.data_dir,
        spec,
        batch_size=cfg.feature_batch,
        progress=progress,
    )
    result["features"] = str(root)
    if cfg.until == "features":
        return result
    store = training_store(root, cfg.extra_data, cfg.data_dir)
    result["train_sequences"] = len(store)
    constants = method.constants(store, config, cfg.init_heads)
    t0 = time.perf_counter()
    state = fit(
        method,
        config,
        plain_params,
        store,
        cfg.out,
        cfg.optim(),
        batch_size=cfg.batch_size,
        max_len=cfg.max_len,
        seed=cfg.seed,
        save_every=cfg.save_every,
        init_params=init_params,
        stop_after=stop_after,
        progress=progress,
        constants=constants,
        group_by_length=cfg.group_by_length,
    )
    result["train_seconds"] = time.perf_counter() - t0
    result["state"] = state
    result["plot"] = str(plot_metrics(cfg.out, f"{cfg.method} on {Path(cfg.base).name}"))
    if int(state.step) < cfg.steps:  # stopped early: no heads yet
        return result
    variables, meta = method.export(jax.device_get(state.params), jax.device_get(constants), config)
    meta.update(
        {
            "base_model": cfg.base,
            "trained_steps": int(state.step),
            "train_prompts": len(store),
            "prompts_file": Path(cfg.prompts).name,
        }
    )
    heads = save_heads(Path(cfg.out) / HEADS_DIR, method.kind, variables, meta)
    result["heads"] = str(heads)
    if cfg.until == "train" or not eval_idx:
        return result
    from specjax.training.evaluate import evaluate, write_report

    proposer, pparams = method.proposer(heads, model)
    report = evaluate(
        model,
        proposer,
        pparams,
        [records[i] for i in eval_idx],
        max_new_tokens=cfg.eval_max_new_tokens,
        progress=progress,
    )
    write_report(Path(cfg.out) / "eval.json", report, method=cfg.method)
    result["eval"] = report
    return result
