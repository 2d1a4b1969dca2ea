"""Resolve a model name or path to parameters, config and tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoint import CheckpointError, load_checkpoint
from specjax.config import ModelConfig


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
    """float32 on CPU (XLA:CPU bfloat16 dots are ~10x slower), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def resolve_model_path(name_or_path: str) -> Path:
    """A checkpoint directory for an embedded name, a directory, or a GGUF file."""
    from convert.registry import is_embedded, resolve_embedded, cache_dir

    if is_embedded(name_or_path):
        return resolve_embedded(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"unknown model '{name_or_path}': not an embedded model name (smollm2-135m) nor an existing path")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"not a checkpoint: {path} (expected a directory or a .gguf file)")
        from convert.gguf import gguf_to_hf

        stat = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / "gguf-converted" / f"{path.stem}-{key}"
        if not (out / "config.json").exists():
            gguf_to_hf(path, out)
        return out
    return path


def load_model(name_or_path: str = "smollm2-135m", dtype=None, mesh=None,
               pack: bool = True) -> Model:
    """Load a model by embedded name, checkpoint directory (specjax or Hugging Face) or GGUF file.

    With a `mesh` (`sharding.make_mesh`), each weight goes from host memory straight into its
    shards (tensor-parallel layers unfused), never whole onto one device. Otherwise, where the
    CPU matmul kernel takes products, the weights come packed for it (`cpu_matmul.pack_params`;
    pack=False keeps them plain [out, in] arrays, e.g. for training).
    """
    path = resolve_model_path(str(name_or_path))
    dtype = default_dtype() if dtype is None else dtype
    params, config, hf_config = load_checkpoint(path, np.float32)
    if mesh is not None:
        from specjax.sharding import shard_params

        params = shard_params(params, config, mesh, dtype)
    else:
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)
        if pack:
            from specjax.cpu_matmul import pack_params

            params = pack_params(params)
    from convert.registry import is_embedded

    name = str(name_or_path) if is_embedded(str(name_or_path)) else None
    return Model(params, config, path, hf_config, name=name)
