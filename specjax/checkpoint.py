"""Reading and writing model weights: Hugging Face directories and specjax checkpoints.

A specjax checkpoint is a directory with `specjax.json` (format marker), the model's Hugging Face
`config.json`, `model.safetensors` in specjax's layout (linear weights [out, in], flat names such
as `layers.3.wq`) and the tokenizer files, so it loads without conversion and converts back.

Weights are read lazily (`SafetensorsTensors`: views of the files' memory maps, bfloat16 as
`ml_dtypes.bfloat16`, no torch) and turned into parameters piece by piece (`param_pieces`: the
embedding, each layer, the norm, the head), so a loader that places each piece as it comes holds
about one layer on the host, not the model; `write_safetensors` writes tensor by tensor likewise.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from specjax.model_config import ConfigError, ModelConfig

FORMAT_FILE = "specjax.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)

# specjax layer key -> HF names under model.layers.{i}. (both store linear weights [out, in]);
# fused keys concatenate their parts in this order along the output axis.
_LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight",),
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "bqkv": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "wo": ("self_attn.o_proj.weight",),
    "bo": ("self_attn.o_proj.bias",),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "mlp_norm": ("post_attention_layernorm.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}
# Specjax checkpoints up to version 1 stored linear weights [in, out]; loading transposes them.
FORMAT_VERSION = 2
LINEAR_KEYS = ("wqkv", "wo", "w_gate_up", "w_down", "wq", "wk", "wv", "w_gate", "w_up")
# safetensors dtype codes; bfloat16 and float8 through ml_dtypes, as JAX names them.
SAFETENSORS_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
_SAFETENSORS_CODES = {np.dtype(t): code for code, t in SAFETENSORS_DTYPES.items()}
_ML_FLOATS = {np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)}
# Header bytes `write_safetensors` reserves per tensor (a name, dtype, shape and two offsets).
HEADER_BYTES_PER_TENSOR = 512
# XLA's CPU client copies a host array aligned to this many bytes straight into a device buffer,
# others through a staging copy of its own (one more copy of each tensor on the host).
HOST_ALIGNMENT = 64


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt JSON in {path}: {e}") from None


def is_floating(dtype) -> bool:
    """Whether `dtype` is a floating-point type (ml_dtypes' bfloat16 and float8 included, whose
    NumPy kind is 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype in _ML_FLOATS


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a HOST_ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def host_copy(arr: np.ndarray, dtype=None) -> np.ndarray:
    """arr copied into a new C-contiguous, aligned array (`aligned_empty`) of `dtype` (None: its
    own): the caller's own, not a view of a mapped file, and one a device takes in one copy."""
    out = aligned_empty(arr.shape, arr.dtype if dtype is None else dtype)
    np.copyto(out, arr, casting="unsafe")
    return out


def _map_safetensors(path: Path) -> tuple[mmap.mmap, dict]:
    """(the file's read-only memory map, {name: (dtype, shape, start, end)}) with byte offsets
    into the file, after checking the header against the file's size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise ValueError(f"a {n}-byte header in a {size}-byte file")
            header = json.loads(f.read(n))
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header.pop("__metadata__", None)
        entries = {}
        for name, info in header.items():
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor '{name}' has unsupported dtype {info['dtype']}")
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
            if begin < 0 or end - begin != int(np.prod(shape)) * dtype.itemsize:
                raise ValueError(f"tensor '{name}' has offsets {[begin, end]} for shape {shape}")
            if 8 + n + end > size:
                raise ValueError(f"tensor '{name}' ends past the end of the file")
            entries[name] = (dtype, shape, 8 + n + begin, 8 + n + end)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None
    return buf, entries


class SafetensorsTensors(Mapping):
    """Tensors by name over safetensors files (one, or a sharded model's), each a read-only NumPy
    view of its file's memory map: a tensor comes from disk only when used, and `release_read()`
    drops the pages of those used so far from this process, so a loader that converts them as it
    goes holds about one at a time. `widen_bfloat16` hands bfloat16 tensors out as float32 (what
    NumPy code that tests `dtype.kind == "f"` expects)."""

    def __init__(self, paths: Iterable[Path], widen_bfloat16: bool = False):
        self._entries = {}
        for path in paths:
            buf, entries = _map_safetensors(Path(path))
            self._entries.update({name: (buf, *entry) for name, entry in entries.items()})
        self._widen = widen_bfloat16
        self._read: set[str] = set()

    def __getitem__(self, name: str) -> np.ndarray:
        buf, dtype, shape, start, _ = self._entries[name]
        self._read.add(name)
        arr = np.frombuffer(buf, dtype, int(np.prod(shape)), start).reshape(shape)
        return arr.astype(np.float32) if self._widen and dtype == ml_dtypes.bfloat16 else arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def release_read(self) -> None:
        """Drop the pages of the tensors read so far from this process's memory (they stay in
        the page cache, and are read again if a view of them is used later)."""
        page = mmap.PAGESIZE
        for name in self._read:
            buf, _, _, start, end = self._entries[name]
            first = start - start % page
            if end > first and hasattr(mmap, "MADV_DONTNEED"):
                buf.madvise(mmap.MADV_DONTNEED, first, end - first)
        self._read.clear()


def release_read(tensors: Mapping) -> None:
    """`SafetensorsTensors.release_read`; nothing for tensors already in memory (a .bin file)."""
    if isinstance(tensors, SafetensorsTensors):
        tensors.release_read()


def read_safetensors(path: Path) -> SafetensorsTensors:
    """The tensors of one safetensors file, read lazily, bfloat16 widened to float32."""
    return SafetensorsTensors([path], widen_bfloat16=True)


def write_safetensors(
    path: Path, named_tensors: Iterable[tuple[str, np.ndarray]], max_tensors: int, metadata: dict | None = None
) -> None:
    """Write (name, array) pairs as a safetensors file one tensor at a time, so they can come
    from a generator that holds one piece of a model at a time.

    The header, known only at the end, goes into space reserved for `max_tensors` entries before
    the data, padded with spaces (the format allows it); the data starts on a page boundary.
    """
    meta = {"__metadata__": metadata} if metadata else {}
    reserve = max_tensors * HEADER_BYTES_PER_TENSOR + len(json.dumps(meta)) + 64
    reserve += -(8 + reserve) % mmap.PAGESIZE
    header, offset = dict(meta), 0
    with open(path, "wb") as f:
        f.seek(8 + reserve)
        for name, arr in named_tensors:
            arr = np.ascontiguousarray(arr)
            if arr.dtype not in _SAFETENSORS_CODES or arr.dtype.byteorder == ">":
                raise CheckpointError(f"tensor '{name}' has dtype {arr.dtype}, which safetensors does not store")
            f.write(arr.reshape(-1).view(np.uint8).data)
            header[name] = {
                "dtype": _SAFETENSORS_CODES[arr.dtype],
                "shape": list(arr.shape),
                "data_offsets": [offset, offset + arr.nbytes],
            }
            offset += arr.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > reserve:
            raise CheckpointError(
                f"{path}: {len(header) - len(meta)} tensors' header does not fit "
                f"the {reserve} bytes reserved for {max_tensors}"
            )
        f.seek(0)
        f.write(reserve.to_bytes(8, "little") + text.ljust(reserve))


def read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} is a PyTorch .bin checkpoint; install torch to read it") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"corrupt or truncated PyTorch checkpoint {path}: {e}") from None
    return {k: v.to(torch.float32).numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def read_hf_tensors(model_dir: Path) -> Mapping[str, np.ndarray]:
    """All tensors of a Hugging Face model directory (safetensors, sharded or not, read lazily as
    stored; or .bin, read whole through torch and widened to float32)."""
    model_dir = Path(model_dir)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.exists():
            files = [model_dir / f for f in sorted(set(read_json(index)["weight_map"].values()))]
            missing = next((f for f in files if not f.exists()), None)
            if missing is not None:
                raise CheckpointError(f"missing weight shard {missing}")
            if index_name.startswith("model.safetensors"):
                return SafetensorsTensors(files)
            return {k: v for f in files for k, v in read_torch_bin(f).items()}
    if (model_dir / "model.safetensors").exists():
        return SafetensorsTensors([model_dir / "model.safetensors"])
    if (model_dir / "pytorch_model.bin").exists():
        return read_torch_bin(model_dir / "pytorch_model.bin")
    raise CheckpointError(f"no weights (model.safetensors or pytorch_model.bin) in {model_dir}")


def tensor_access(tensors: Mapping[str, np.ndarray], source: str = "checkpoint", dtype=np.float32):
    """(get, expect): fetch a tensor by name, and check that it is a floating-point weight of the
    config's shape, copied as `dtype` (None: as stored; `host_copy`) unless copy=False, with
    errors that name it."""

    def get(name):
        if name not in tensors:
            raise CheckpointError(f"{source} lacks tensor '{name}'")
        return tensors[name]

    def expect(name, arr, shape, copy=True):
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor '{name}' has shape {tuple(arr.shape)}, config says {shape}")
        if not is_floating(arr.dtype):
            raise CheckpointError(f"tensor '{name}' has dtype {arr.dtype}, not a floating-point weight")
        if not copy:  # checked only (a part the caller copies into a fused weight)
            return arr
        out = host_copy(arr, dtype)
        release_read(tensors)  # copied: its file pages can go
        return out

    return get, expect


def _hf_layer_shapes(config: ModelConfig) -> dict[str, tuple]:
    """Shape of each HF tensor of a decoder layer, by its name under model.layers.{i}."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.o_proj.bias": (d,),
        "self_attn.q_norm.weight": (config.head_dim,),
        "self_attn.k_norm.weight": (config.head_dim,),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }


def _param_shapes(config: ModelConfig) -> dict[str, tuple]:
    """Shape of each specjax parameter, by its top-level or layer key (fused keys: the sum of
    their parts along the output axis)."""
    hf = _hf_layer_shapes(config)
    shapes = {key: (sum(hf[s][0] for s in parts),) + hf[parts[0]][1:] for key, parts in _LAYER_KEYS.items()}
    v, d = config.vocab_size, config.hidden_size
    return {**shapes, "embed": (v, d), "lm_head": (v, d), "norm": (d,)}


def hf_param_pieces(
    tensors: Mapping[str, np.ndarray], config: ModelConfig, dtype=np.float32
) -> Iterator[tuple[str | int, object]]:
    """specjax parameters from Hugging Face tensor names, piece by piece: ("embed", array), then
    (i, layer i's dict) for each layer, ("norm", array) and ("lm_head", array) if untied."""
    get, expect = tensor_access(tensors, dtype=dtype)
    shapes = _param_shapes(config)
    yield "embed", expect("model.embed_tokens.weight", get("model.embed_tokens.weight"), shapes["embed"])
    for i in range(config.num_layers):
        yield i, hf_layer_params(get, expect, f"model.layers.{i}.", config, dtype=dtype)
    yield "norm", expect("model.norm.weight", get("model.norm.weight"), shapes["norm"])
    if not config.tie_word_embeddings:
        yield "lm_head", expect("lm_head.weight", get("lm_head.weight"), shapes["lm_head"])


def assemble_params(pieces: Iterable[tuple[str | int, object]], place=None) -> dict:
    """The parameter pytree from (key, value) pieces (an int key: that layer), each passed
    through place(key, value) first when given (e.g. onto its device)."""
    params: dict = {"layers": []}
    for key, value in pieces:
        value = value if place is None else place(key, value)
        if isinstance(key, int):
            params["layers"].append(value)
        else:
            params[key] = value
    return params


def param_items(params: dict) -> Iterator[tuple[str | int, object]]:
    """A parameter pytree as (key, value) pieces: top-level arrays, then (i, layer i)."""
    yield from ((k, v) for k, v in params.items() if k != "layers")
    yield from enumerate(params["layers"])


def hf_layer_params(get, expect, prefix: str, config: ModelConfig, input_norm: bool = True, dtype=np.float32) -> dict:
    """One decoder layer's specjax parameters from HF tensor names under `prefix`.

    get(name) returns a tensor (or raises naming it); expect(name, array, shape, copy) checks
    shapes (`tensor_access`); fused weights are concatenated as `dtype`, as expect copies.
    """
    shapes = _hf_layer_shapes(config)
    layer = {}
    for key in layer_keys(config):
        if key == "attn_norm" and not input_norm:
            continue
        suffixes = _LAYER_KEYS[key]
        if len(suffixes) == 1:
            layer[key] = expect(prefix + suffixes[0], get(prefix + suffixes[0]), shapes[suffixes[0]])
        else:
            parts = [expect(prefix + s, get(prefix + s), shapes[s], copy=False) for s in suffixes]
            layer[key] = concatenate_rows(parts, dtype)
    return layer


def layer_keys(config: ModelConfig) -> list[str]:
    """The specjax keys a decoder layer of `config` holds (fused layout), in `_LAYER_KEYS` order."""
    optional = {"bqkv": config.attention_bias, "bo": config.o_proj_bias}
    optional |= {"q_norm": config.qk_norm, "k_norm": config.qk_norm}
    return [key for key in _LAYER_KEYS if optional.get(key, True)]


def concatenate_rows(parts: list[np.ndarray], dtype=None) -> np.ndarray:
    """The parts stacked along their first axis (a fused weight) into one aligned array of
    `dtype` (None: the parts' common type), converted on the way."""
    shape = (sum(p.shape[0] for p in parts),) + parts[0].shape[1:]
    out = aligned_empty(shape, np.result_type(*parts) if dtype is None else dtype)
    return np.concatenate(parts, axis=0, out=out, casting="unsafe")


def _hf_named(key: str | int, value, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """A parameter piece's Hugging Face tensors (names, [out, in] layout; fused keys split)."""
    if not isinstance(key, int):
        name = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}[key]
        yield name, np.asarray(value)
        return
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    widths = {"wqkv": [q, kv, kv], "bqkv": [q, kv, kv], "w_gate_up": [config.intermediate_size] * 2}
    for k, arr in value.items():
        arr = np.asarray(arr)
        parts = np.split(arr, np.cumsum(widths[k])[:-1], axis=0) if k in widths else [arr]
        for suffix, part in zip(_LAYER_KEYS[k], parts):
            yield f"model.layers.{key}.{suffix}", np.ascontiguousarray(part)


def _flat_named(key: str | int, value) -> Iterator[tuple[str, np.ndarray]]:
    """A parameter piece's tensors under specjax's flat names (`embed`, `layers.3.wqkv`)."""
    if isinstance(key, int):
        yield from ((f"layers.{key}.{k}", np.asarray(v)) for k, v in value.items())
    else:
        yield key, np.asarray(value)


def params_to_hf(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Hugging Face tensor names and [out, in] layout from a specjax parameter pytree."""
    return {name: arr for key, value in param_items(params) for name, arr in _hf_named(key, value, config)}


def specjax_param_pieces(
    tensors: Mapping[str, np.ndarray], config: ModelConfig, dtype=np.float32, version: int = FORMAT_VERSION
) -> Iterator[tuple[str | int, object]]:
    """specjax parameters from a specjax checkpoint's flat names, piece by piece (top-level
    arrays, then each layer), shapes checked against the config before conversion to `dtype`
    (None: as stored). Names are checked before any tensor is read."""
    layer_names: list[dict] = [{} for _ in range(config.num_layers)]
    top = []
    for name in tensors:
        if name.startswith("layers."):
            _, i, key = name.split(".", 2)
            if int(i) >= config.num_layers:
                raise CheckpointError(f"tensor '{name}' beyond num_hidden_layers={config.num_layers}")
            layer_names[int(i)][key] = name
        else:
            top.append(name)
    for key in ("embed", "norm") + (() if config.tie_word_embeddings else ("lm_head",)):
        if key not in top:
            raise CheckpointError(f"specjax checkpoint lacks tensor '{key}'")
    needed = set(layer_keys(config)) - {"bqkv"}
    for i, names in enumerate(layer_names):
        missing = needed - set(names)
        if missing:
            raise CheckpointError(f"specjax checkpoint lacks layers.{i}.{sorted(missing)[0]}")
    get, expect = tensor_access(tensors, dtype=dtype)
    shapes = _param_shapes(config)

    def read(name, key):
        arr = get(name)
        if version < 2 and key in LINEAR_KEYS:
            arr = arr.T
        if key in shapes:
            return expect(name, arr, shapes[key])
        return host_copy(arr, dtype if is_floating(arr.dtype) else None)

    yield from ((name, read(name, name)) for name in top)
    for i, names in enumerate(layer_names):
        yield i, {key: read(name, key) for key, name in names.items()}


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def atomic_dir(out_dir: Path):
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def finish_dir(tmp: Path, out_dir: Path):
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def _max_tensors(config: ModelConfig) -> int:
    """At most how many tensors a model's parameters write as (HF names, biases included)."""
    return 3 + config.num_layers * sum(len(parts) for parts in _LAYER_KEYS.values())


def _save_model_dir(
    out_dir: Path,
    params,
    config: ModelConfig,
    hf_config: dict | None,
    tokenizer_dir: Path | None,
    named,
    metadata: dict | None,
    format_marker: bool,
) -> Path:
    """Write a model directory (atomically: a crash leaves no half checkpoint) from `params`, a
    pytree or (key, value) pieces (`param_pieces`), each piece written as `named` names it."""
    out_dir = Path(out_dir)
    pieces = param_items(params) if isinstance(params, dict) else params
    tmp = atomic_dir(out_dir)
    try:
        write_safetensors(
            tmp / WEIGHTS_FILE,
            (item for key, value in pieces for item in named(key, value)),
            _max_tensors(config),
            metadata,
        )
    except BaseException:  # pieces are read while writing: a bad tensor leaves no directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "config.json").write_text(json.dumps(hf_config or config.to_hf(), indent=2))
    if format_marker:
        (tmp / FORMAT_FILE).write_text(json.dumps({"format": "specjax", "version": FORMAT_VERSION, "kind": "model"}))
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), tmp)
    finish_dir(tmp, out_dir)
    return out_dir


def save_specjax(
    out_dir: Path, params, config: ModelConfig, hf_config: dict | None = None, tokenizer_dir: Path | None = None
) -> Path:
    """Write a specjax checkpoint from a parameter pytree or (key, value) pieces."""
    return _save_model_dir(out_dir, params, config, hf_config, tokenizer_dir, _flat_named, None, format_marker=True)


def save_hf(
    out_dir: Path, params, config: ModelConfig, hf_config: dict | None = None, tokenizer_dir: Path | None = None
) -> Path:
    """Write a Hugging Face model directory (config.json + model.safetensors + tokenizer) from a
    parameter pytree or (key, value) pieces."""
    named = lambda key, value: _hf_named(key, value, config)
    return _save_model_dir(
        out_dir, params, config, hf_config, tokenizer_dir, named, {"format": "pt"}, format_marker=False
    )


def is_specjax_checkpoint(path: Path) -> bool:
    return (Path(path) / FORMAT_FILE).exists()


def read_config(path: Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, HF config dict) of a specjax or Hugging Face checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint directory: {path}")
    if not (path / "config.json").exists():
        raise CheckpointError(f"not a checkpoint: {path} has no config.json")
    hf_config = read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf(hf_config)
    except ConfigError:
        raise
    return config, hf_config


def param_pieces(path: Path, config: ModelConfig, dtype=np.float32) -> Iterator[tuple[str | int, object]]:
    """A checkpoint's parameters as (key, value) pieces (`hf_param_pieces`), each converted to
    `dtype` (None: as stored) when it is asked for. The file pages a piece was read from are
    dropped when the next one is asked for, so a consumer that places or writes each piece
    before asking for the next holds about one piece of the model on the host."""
    path = Path(path)
    if is_specjax_checkpoint(path):
        weights = path / WEIGHTS_FILE
        if not weights.exists():
            raise CheckpointError(f"missing weights file {weights}")
        tensors = SafetensorsTensors([weights])
        version = int(read_json(path / FORMAT_FILE).get("version", 1))
        pieces = specjax_param_pieces(tensors, config, dtype, version)
    else:
        tensors = read_hf_tensors(path)
        pieces = hf_param_pieces(tensors, config, dtype)
    for piece in pieces:
        yield piece
        release_read(tensors)


def load_checkpoint(path: Path, dtype=np.float32) -> tuple[dict, ModelConfig, dict]:
    """(params as numpy arrays of `dtype`, ModelConfig, HF config dict) from a specjax or Hugging
    Face directory."""
    config, hf_config = read_config(path)
    return assemble_params(param_pieces(path, config, dtype)), config, hf_config
