"""Teacher-forced features of the base model over prompt + answer, sharded to disk as .npy.

Per token a shard keeps the token id, the answer mask (train on answers only), the final normed
hidden state (Medusa, EAGLE-1) and, when a method asks for them, the residual streams after
chosen decoder layers (EAGLE-3 fuses three). Shards are written to a temporary folder and renamed
when complete, so an interrupted extraction resumes at the first missing shard.

Shard layout (`features/<spec key>/shard_00000/`): tokens.npy int32[N], mask.npy bool[N],
offsets.npy int64[S + 1] (sequence s is rows offsets[s]:offsets[s+1]), final.npy [N, D],
layer_{i}.npy [N, D], all float16 or float32.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import PagedKVCache, init_pages
from specjax.model import causal_mask, forward
from specjax.model_config import ModelConfig

FEATURES_DIR = "features"


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """What a method reads per token: the final hidden state and/or some layers' outputs."""

    final: bool = True
    layers: tuple[int, ...] = ()
    dtype: str = "float16"  # storage: float16 halves the disk, float32 is exact

    @property
    def key(self) -> str:
        parts = (["final"] if self.final else []) + [f"l{i}" for i in self.layers]
        return "+".join(parts) + f"-{self.dtype}"

    @property
    def names(self) -> tuple[str, ...]:
        return (("final",) if self.final else ()) + tuple(f"layer_{i}" for i in self.layers)


def scratch_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> PagedKVCache:
    """An empty paged cache of one `length`-slot page per sequence (teacher forcing, training)."""
    k, v = init_pages(config, batch, length, dtype)
    return PagedKVCache(k, v, jnp.arange(batch, dtype=jnp.int32)[:, None], jnp.zeros((batch,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "final", "layers"))
def teacher_forward(params, config: ModelConfig, tokens, valid, final: bool = True, layers: tuple[int, ...] = ()):
    """Hidden states of a teacher-forced pass: {"final": [B, T, D], "layer_i": [B, T, D]}.

    tokens, valid: [B, T] (right padding is invalid and never attended to).
    """
    b, t = tokens.shape
    cache = scratch_cache(config, b, t, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = forward(
        params,
        config,
        tokens,
        positions,
        cache,
        causal_mask(b, t),
        valid=valid,
        logits_at=jnp.zeros((b, 0), jnp.int32),
        hidden_layers=layers,
    )
    res = {f"layer_{i}": h.astype(jnp.float32) for i, h in zip(layers, out.layer_hiddens)}
    if final:
        res["final"] = out.hidden.astype(jnp.float32)
    return res


def length_bucket(n: int, minimum: int = 32) -> int:
    """Power-of-two padded length: few shapes, so few compiles."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def extract_features(
    params,
    config: ModelConfig,
    sequences: Sequence[tuple[np.ndarray, np.ndarray]],
    folder,
    spec: FeatureSpec = FeatureSpec(),
    *,
    batch_size: int = 8,
    shard_size: int = 256,
    progress: bool = True,
) -> Path:
    """Write the features of `sequences` [(tokens, answer mask)] under folder; resumable.

    Returns the spec's shard folder. Sequence s lands in shard s // shard_size, in order.
    """
    from tqdm import tqdm

    for i in spec.layers:
        if not 0 <= i < config.num_layers:
            raise ValueError(f"feature layer {i} outside [0, {config.num_layers})")
    root = Path(folder) / FEATURES_DIR / spec.key
    root.mkdir(parents=True, exist_ok=True)
    meta = {
        "num_sequences": len(sequences),
        "shard_size": shard_size,
        "hidden_size": config.hidden_size,
        **dataclasses.asdict(spec),
    }
    meta["layers"] = list(spec.layers)
    meta_path = root / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta and not _grown(root, old, meta, sequences):
            diff = next(k for k in meta if old.get(k) != meta[k])
            raise ValueError(
                f"features in {root} were made with {diff}={old.get(diff)!r}, "
                f"not {meta[diff]!r}: use another data folder"
            )
    meta_path.write_text(json.dumps(meta, indent=2))
    n_shards = -(-len(sequences) // shard_size)
    store_dtype = np.dtype(spec.dtype)
    missing = [s for s in range(n_shards) if not (root / f"shard_{s:05d}").exists()]
    bar = tqdm(
        total=len(sequences),
        disable=not progress,
        desc="features",
        unit="seq",
        dynamic_ncols=True,
        initial=len(sequences) - sum(len(sequences[s * shard_size : (s + 1) * shard_size]) for s in missing),
    )
    for s in missing:
        seqs = sequences[s * shard_size : (s + 1) * shard_size]
        outs: list[dict] = [None] * len(seqs)  # type: ignore[list-item]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        for j in range(0, len(order), batch_size):
            idx = order[j : j + batch_size]
            t = length_bucket(max(len(seqs[i][0]) for i in idx))
            tok = np.zeros((batch_size, t), np.int32)
            val = np.zeros((batch_size, t), bool)
            for r, i in enumerate(idx):
                n = len(seqs[i][0])
                tok[r, :n] = seqs[i][0]
                val[r, :n] = True
            res = jax.device_get(
                teacher_forward(params, config, jnp.asarray(tok), jnp.asarray(val), spec.final, spec.layers)
            )
            for r, i in enumerate(idx):
                n = len(seqs[i][0])
                outs[i] = {k: v[r, :n].astype(store_dtype) for k, v in res.items()}
            bar.update(len(idx))
        tmp = root / f"shard_{s:05d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        np.save(tmp / "tokens.npy", np.concatenate([q[0] for q in seqs]).astype(np.int32))
        np.save(tmp / "mask.npy", np.concatenate([q[1] for q in seqs]).astype(bool))
        np.save(tmp / "offsets.npy", np.cumsum([0] + [len(q[0]) for q in seqs]).astype(np.int64))
        for name in spec.names:
            np.save(tmp / f"{name}.npy", np.concatenate([o[name] for o in outs]))
        tmp.rename(root / f"shard_{s:05d}")
    bar.close()
    return root


def _grown(root: Path, old: dict, meta: dict, sequences) -> bool:
    """Whether the folder holds features of a prefix of `sequences` (the data grew, e.g. more
    prompts answered in the same order); if so its last, partial shard is dropped to be redone
    with the new sequences. Shards are compared token by token."""
    if {k: v for k, v in old.items() if k != "num_sequences"} != {
        k: v for k, v in meta.items() if k != "num_sequences"
    }:
        return False
    n_old, size = old["num_sequences"], old["shard_size"]
    if n_old >= len(sequences):
        return False
    for s in range(-(-n_old // size)):
        d = root / f"shard_{s:05d}"
        if not d.exists():
            continue
        seqs = sequences[s * size : min((s + 1) * size, n_old)]
        offsets = np.cumsum([0] + [len(q[0]) for q in seqs])
        if not np.array_equal(np.load(d / "offsets.npy"), offsets) or not np.array_equal(
            np.load(d / "tokens.npy"), np.concatenate([q[0] for q in seqs])
        ):
            return False
    if n_old % size:
        shutil.rmtree(root / f"shard_{n_old // size:05d}", ignore_errors=True)
    return True


def padded_sequences(seqs: Sequence[tuple[np.ndarray, np.ndarray]], t: int) -> dict[str, np.ndarray]:
    """tokens int32[B, t], mask bool[B, t] (answer tokens) and valid bool[B, t] of (tokens,
    answer mask) pairs, right-padded (or cut) to t."""
    b = len(seqs)
    out = {"tokens": np.zeros((b, t), np.int32), "mask": np.zeros((b, t), bool), "valid": np.zeros((b, t), bool)}
    for r, (tokens, mask) in enumerate(seqs):
        n = min(len(tokens), t)
        out["tokens"][r, :n], out["mask"][r, :n], out["valid"][r, :n] = tokens[:n], mask[:n], True
    return out


class FeatureStore:
    """Read-only view of a feature folder (memory-mapped shards)."""

    def __init__(self, root):
        self.root = Path(root)
        meta_path = self.root / "meta.json"
        if not meta_path.exists():
            raise ValueError(f"no features in {self.root}")
        self.meta = json.loads(meta_path.read_text())
        self.spec = FeatureSpec(self.meta["final"], tuple(self.meta["layers"]), self.meta["dtype"])
        n = self.meta["num_sequences"]
        size = self.meta["shard_size"]
        self.shards = []
        for s in range(-(-n // size)):
            d = self.root / f"shard_{s:05d}"
            if not d.exists():
                raise ValueError(f"feature shard {d} is missing: extraction did not finish")
            self.shards.append({p.stem: np.load(p, mmap_mode="r") for p in d.glob("*.npy")})
        self.size = size
        self.lengths = np.concatenate([np.diff(sh["offsets"]) for sh in self.shards])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    def sequence(self, i: int) -> dict[str, np.ndarray]:
        sh = self.shards[i // self.size]
        a, b = sh["offsets"][i % self.size], sh["offsets"][i % self.size + 1]
        return {k: v[a:b] for k, v in sh.items() if k != "offsets"}

    def batch(self, ids: Sequence[int], max_len: int) -> dict[str, np.ndarray]:
        """Padded arrays of sequences `ids`, cut to max_len, length padded to a power of two.

        tokens int32[B, T], mask bool[B, T] (answer tokens), valid bool[B, T], and every
        feature as float32[B, T, D].
        """
        seqs = [self.sequence(int(i)) for i in ids]
        t = min(length_bucket(max(len(s["tokens"]) for s in seqs)), length_bucket(max_len))
        out = padded_sequences([(s["tokens"][:max_len], s["mask"][:max_len]) for s in seqs], t)
        for name in self.spec.names:
            out[name] = np.zeros((len(ids), t, self.hidden_size), np.float32)
            for r, s in enumerate(seqs):
                n = min(len(s["tokens"]), max_len, t)
                out[name][r, :n] = s[name][:n]
        return out


class FeatureStores(FeatureStore):
    """Several feature folders of one spec read as one: sequence i runs through them in order.

    Lets a run train on answers distilled in other data folders (e.g. an earlier batch of
    prompts) without extracting their features again.
    """

    def __init__(self, stores: Sequence[FeatureStore]):
        first = stores[0]
        for st in stores[1:]:
            if st.spec != first.spec or st.hidden_size != first.hidden_size:
                raise ValueError(
                    f"features in {st.root} ({st.spec.key}, hidden size "
                    f"{st.hidden_size}) do not match {first.root} ({first.spec.key}, "
                    f"hidden size {first.hidden_size})"
                )
        self.parts = list(stores)
        self.root, self.meta, self.spec = first.root, first.meta, first.spec
        self.lengths = np.concatenate([st.lengths for st in stores])
        self.starts = np.cumsum([0] + [len(st) for st in stores])

    def sequence(self, i: int) -> dict[str, np.ndarray]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k].sequence(i - int(self.starts[k]))
