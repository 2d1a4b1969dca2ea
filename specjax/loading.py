"""Resolve a model name or path to parameters, config and tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoint import CheckpointError, assemble_params, param_pieces, read_config
from specjax.model_config import ModelConfig


@dataclasses.dataclass
class Model:
    """A loaded model: parameter pytree on device, its config, tokenizer and source directory."""

    params: dict
    config: ModelConfig
    path: Path
    hf_config: dict
    _tokenizer: object = None
    name: str | None = None  # the embedded name when loaded by one (e.g. "smollm2-135m")

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


# What AutoTokenizer resolves these names to is this class itself (the second is the first's name
# since transformers 5).
PLAIN_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. A plain fast tokenizer (what the GGUF converter writes) loads
    without AutoTokenizer, which would import torch for the model config (seconds per command)."""
    path = Path(path)
    try:
        if _tokenizer_class(path) in PLAIN_FAST_TOKENIZERS and (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast as Tokenizer
        else:
            from transformers import AutoTokenizer as Tokenizer
        return Tokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None


def _tokenizer_class(path: Path):
    """The tokenizer_class named in the checkpoint's tokenizer_config.json, if any."""
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def default_dtype():
    """float32 on CPU (XLA:CPU's bfloat16 dots are far slower), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def resolve_model_path(name_or_path: str) -> Path:
    """A checkpoint directory for an embedded name, a directory, or a GGUF file."""
    from specjax.convert.registry import cache_dir, is_embedded, resolve_embedded

    if is_embedded(name_or_path):
        return resolve_embedded(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"unknown model '{name_or_path}': not an embedded model name (smollm2-135m) nor an existing path"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"not a checkpoint: {path} (expected a directory or a .gguf file)")
        from specjax.convert.gguf import gguf_to_hf

        stat = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / "gguf-converted" / f"{path.stem}-{key}"
        if not (out / "config.json").exists():
            gguf_to_hf(path, out)
        return out
    return path


def _placer(config: ModelConfig, mesh, pack: bool):
    """place(key, value) for `assemble_params`: a parameter piece (host arrays already of the
    model's dtype) onto the device, or into its shards over `mesh`; with `pack`, a layer's
    matrices packed for the CPU matmul kernel on the host first. It waits for the copies, so the
    piece's host arrays are freed before the next piece is read, not queued behind transfers."""
    from specjax.cpu.matmul import pack_layer
    from specjax.sharding import shard_params

    def put(key, value):
        if mesh is not None:
            piece = {"layers": [value]} if isinstance(key, int) else {"layers": [], key: value}
            placed = shard_params(piece, config, mesh)
            return placed["layers"][0] if isinstance(key, int) else placed[key]
        if pack and isinstance(key, int):
            value = pack_layer(value)
        return jax.tree_util.tree_map(jnp.asarray, value)

    return lambda key, value: jax.block_until_ready(put(key, value))


def load_model(name_or_path: str = "smollm2-135m", dtype=None, mesh=None, pack: bool = True) -> Model:
    """Load a model by embedded name, checkpoint directory (specjax or Hugging Face) or GGUF file.

    The weights stream from the file: each piece (the embedding, a layer, the norm, the head) is
    converted to `dtype` and placed as soon as it is read, so the host holds about one layer
    beyond what the result needs (a bfloat16 checkpoint asked for as bfloat16 stays bfloat16).
    With a `mesh` (`sharding.make_mesh`), each weight goes from host memory straight into its
    shards (tensor-parallel layers unfused), never whole onto one device. Otherwise, where the
    CPU matmul kernel takes products, the weights come packed for it (`cpu.matmul.pack_params`;
    pack=False keeps them plain [out, in] arrays, e.g. for training).
    """
    path = resolve_model_path(str(name_or_path))
    dtype = default_dtype() if dtype is None else dtype
    config, hf_config = read_config(path)
    from specjax.cpu.matmul import kernel_in_use, pack_params

    pieces = param_pieces(path, config, np.dtype(dtype))
    # The first piece opens the checkpoint's files and checks them, so a broken checkpoint is
    # reported before the CPU kernels are built (tens of seconds the first time).
    first = next(pieces)
    pack = pack and mesh is None and np.dtype(dtype) == np.float32 and kernel_in_use()
    params = assemble_params(itertools.chain([first], pieces), _placer(config, mesh, pack))
    if pack:
        params = pack_params(params)  # the output head (the layers are packed already)
    from specjax.convert.registry import is_embedded

    name = str(name_or_path) if is_embedded(str(name_or_path)) else None
    return Model(params, config, path, hf_config, name=name)
