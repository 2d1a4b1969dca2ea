"""Tensor and data parallelism over a device mesh ("data", "model"), on one host or several.

Megatron-style placement (docs/gpu.md, "Several GPUs", has the outline; the detail is here):
- q/k/v and gate/up are column-parallel, `P(None, "model")`, o/down row-parallel,
  `P("model", None)`: each device holds whole heads (q heads h with h // G among its own KV
  heads, as the attention's [KVH, G] grouping needs) and 1/tp of the MLP, and XLA adds one
  all-reduce after each row-parallel product. The fused `wqkv` / `w_gate_up` matrices of the
  single-device fast path would mix q, k and v in a column split, so for tp > 1 the layers are
  unfused (`wq`, `wk`, `wv`, `bq`, `bk`, `bv`, `w_gate`, `w_up`) on the host before placement.
- The embedding and lm_head are vocabulary-parallel, `P("model", None)`; norms replicated.
- KV page pools [KVH, P + 1, page, D] split over KV heads; per-sequence arrays (tokens, lengths,
  block tables, keys, features, proposer state) over "data". Pools are replicated over "data":
  the host allocator hands any page to any sequence.

How the loops are jitted: inputs are committed to their shardings (parameters by `shard_params`,
host data by `put_batch`/`put_replicated`), so jit compiles for exactly those input shardings,
and the loops (`generate.decode_loop`, `spec_decode.spec_loop`, given the mesh) pin their carry
through `pinning` (cache, state, proposer state) with
`with_sharding_constraint` at the loop's entry, in its body and at its exit, which also fixes the
outputs' shardings. That is pjit's in/out sharding contract, written as a rule over the traced
pytree rather than a sharding pytree per function: the proposer states of the nine methods all
differ, and one rule (pools by name over KV heads, leading batch axis over "data") covers them.

Multi-host: `init_distributed` calls `jax.distributed.initialize` (gloo collectives on CPU);
every process then runs the same program over the global mesh.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.model_config import ModelConfig

AXES = ("data", "model")
POOL_NAMES = ("k_pages", "v_pages")
# Unfused layer weights: column-parallel (outputs split), row-parallel (inputs split), biases.
LAYER_SPECS = {
    "wq": P("model", None),
    "wk": P("model", None),
    "wv": P("model", None),
    "bq": P("model"),
    "bk": P("model"),
    "bv": P("model"),
    "w_gate": P("model", None),
    "w_up": P("model", None),
    "wo": P(None, "model"),
    "w_down": P(None, "model"),
}
VOCAB_PARALLEL = P("model", None)


class ShardingError(ValueError):
    """A mesh or model that cannot be split as asked."""


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join a multi-process JAX runtime (call before any other JAX use).

    On CPU the cross-process collectives need gloo, which must be chosen before the backend
    starts; the option is ignored by GPU/TPU backends.
    """
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ShardingError(f"process id {process_id} outside [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A (dp, tp) mesh with axes ("data", "model") over the first dp * tp devices."""
    if tp < 1 or dp < 1:
        raise ShardingError(f"tp and dp must be >= 1, got tp={tp} dp={dp}")
    devices = jax.devices() if devices is None else list(devices)
    if tp * dp > len(devices):
        raise ShardingError(
            f"tp={tp} x dp={dp} needs {tp * dp} devices, but only {len(devices)} {devices[0].platform} device(s) exist"
        )
    return Mesh(np.asarray(devices[: tp * dp], dtype=object).reshape(dp, tp), AXES)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape["model"]


def dp_size(mesh: Mesh) -> int:
    return mesh.shape["data"]


def check_divisible(config: ModelConfig, tp: int, what: str = "model") -> None:
    """One-line error when the heads, intermediate size or vocabulary do not split over tp."""
    for name, n in (
        ("KV heads", config.num_kv_heads),
        ("attention heads", config.num_heads),
        ("intermediate size", config.intermediate_size),
        ("vocabulary", config.vocab_size),
    ):
        if n % tp:
            raise ShardingError(f"tp={tp} does not divide the {what}'s {n} {name}")


def _splittable(config, tp: int) -> bool:
    return isinstance(config, ModelConfig) and all(
        n % tp == 0 for n in (config.num_kv_heads, config.num_heads, config.intermediate_size)
    )


def unfuse_layer(layer: dict, config: ModelConfig) -> dict:
    """The layer with `wqkv`/`bqkv`/`w_gate_up` split into their parts (host numpy arrays)."""
    if "wqkv" not in layer:
        return dict(layer)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {k: v for k, v in layer.items() if k not in ("wqkv", "bqkv", "w_gate_up")}
    out["wq"], out["wk"], out["wv"] = np.split(_host(layer["wqkv"]), [q, q + kv], axis=0)
    if "bqkv" in layer:
        out["bq"], out["bk"], out["bv"] = np.split(_host(layer["bqkv"]), [q, q + kv], axis=-1)
    out["w_gate"], out["w_up"] = np.split(_host(layer["w_gate_up"]), 2, axis=0)
    return out


def _host(x):
    return np.asarray(x)


def put(x, sharding: NamedSharding, dtype=None):
    """x placed with `sharding`, each device receiving only its shard (works across hosts).

    Host arrays go shard by shard through `make_array_from_callback` (no full copy on one
    device); arrays already placed so are returned as they are.
    """
    if isinstance(x, jax.Array):
        if x.sharding == sharding and (dtype is None or x.dtype == dtype):
            return x
        if not x.is_fully_addressable:  # spread over hosts: reshard on device
            return jax.jit(lambda a: a if dtype is None else a.astype(dtype), out_shardings=sharding)(x)
    host = np.asarray(x)
    if dtype is not None:
        host = host.astype(dtype)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _named(mesh, spec):
    return NamedSharding(mesh, spec)


def shard_params(params: dict, config: ModelConfig, mesh: Mesh, dtype=None) -> dict:
    """The target's parameters placed on `mesh` (unfused first when tp > 1).

    Accepts host (numpy) or device arrays, fused or already unfused layers; each array goes
    straight into its shards.
    """
    tp = tp_size(mesh)
    if tp == 1:  # data parallel only: replicate the fused single-device layout
        return jax.tree_util.tree_map(lambda a: put(a, _named(mesh, P()), dtype), params)
    check_divisible(config, tp)
    layers = []
    for layer in params["layers"]:
        layer = unfuse_layer(layer, config)
        layers.append({k: put(v, _named(mesh, LAYER_SPECS.get(k, P())), dtype) for k, v in layer.items()})
    out = {"layers": layers}
    for k, v in params.items():
        if k != "layers":
            out[k] = put(v, _named(mesh, VOCAB_PARALLEL if k in ("embed", "lm_head") else P()), dtype)
    return out


def _vocab_spec(shape, vocab: int, tp: int) -> P:
    """Split an array's vocabulary axis (a [V, D] head or a [D, V] kernel) over "model"."""
    if tp > 1 and vocab % tp == 0 and len(shape) == 2:
        if shape[0] == vocab:
            return P("model", None)
        if shape[1] == vocab:
            return P(None, "model")
    return P()


def shard_proposer_params(proposer, params, mesh: Mesh, vocab_size: int):
    """A proposer's parameters placed on `mesh`.

    Draft decoder layers run through `model.decoder_layers` (a draft model, EAGLE-1/2's draft
    layer) take the target layers' specs when their heads split over tp; vocabulary-sized
    matrices (shared or own heads, Medusa's [D, V] kernels) are vocabulary-parallel; everything
    else (Medusa ResBlocks, EAGLE's fc, EAGLE-3's network) is replicated.
    """
    if params is None:
        return None
    tp = tp_size(mesh)
    config = proposer.config
    unfuse = tp > 1 and _splittable(config, tp) and proposer.splits_draft_layers

    def walk(node):
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if (
                    k == "layers"
                    and unfuse
                    and isinstance(v, (list, tuple))
                    and all(isinstance(l, dict) and ("wqkv" in l or "wq" in l) for l in v)
                ):
                    out[k] = [
                        {
                            n: put(a, _named(mesh, LAYER_SPECS.get(n, P())))
                            for n, a in unfuse_layer(layer, config).items()
                        }
                        for layer in v
                    ]
                else:
                    out[k] = walk(v)
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        if node is None or not hasattr(node, "shape"):
            return node
        return put(node, _named(mesh, _vocab_spec(node.shape, vocab_size, tp)))

    return walk(params)


def _pool_spec(shape, tp: int) -> P:
    return P("model", None, None, None) if shape[0] % tp == 0 else P()


def state_shardings(mesh: Mesh, tree, batch: int | None, pools: bool = False):
    """NamedShardings of a loop carry (arrays or tracers): KV pools (leaves under `k_pages` /
    `v_pages`, or every 4-D leaf with pools=True) over KV heads, leaves whose leading axis is
    the batch over "data", the rest replicated."""
    tp, dp = tp_size(mesh), dp_size(mesh)

    def spec(path, x):
        shape = getattr(x, "shape", ())
        named = any(getattr(k, "name", getattr(k, "key", None)) in POOL_NAMES for k in path)
        if len(shape) == 4 and (named or pools):
            return _named(mesh, _pool_spec(shape, tp))
        if batch is not None and len(shape) >= 1 and shape[0] == batch and batch % dp == 0:
            return _named(mesh, P("data"))
        return _named(mesh, P())

    return jax.tree_util.tree_map_with_path(spec, tree)


def constrain(mesh: Mesh, tree, batch: int | None):
    """`tree` pinned to `state_shardings` (inside jit)."""
    return jax.lax.with_sharding_constraint(tree, state_shardings(mesh, tree, batch))


def pinning(mesh: Mesh | None, batch: int | None):
    """The function the engine's loops pin their carries with: `constrain` over `mesh` for a
    batch of `batch` sequences, or the identity without a mesh. Pinned at a loop's entry, in
    its body and at its exit, the carry keeps its shardings (pjit's in/out contract)."""
    if mesh is None:
        return lambda tree: tree
    return functools.partial(constrain, mesh, batch=batch)


def sharded_init(mesh: Mesh, make):
    """The pytree of arrays `make()` builds (KV pools), created directly in its shards."""
    shapes = jax.eval_shape(make)
    return jax.jit(make, out_shardings=state_shardings(mesh, shapes, None, pools=True))()


def put_batch(mesh: Mesh, x):
    """A host array whose leading axis is the batch, split over "data"."""
    x = np.asarray(x)
    return put(x, _named(mesh, P("data") if x.ndim else P()))


def put_replicated(mesh: Mesh, x):
    return put(np.asarray(x), _named(mesh, P()))


def to_host(x):
    """A numpy copy of a (possibly multi-host) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
