"""specjax: speculative decoding for LLMs as pure JAX functions."""

from specjax.cache import CacheFullError, PageAllocator, PagedKVCache
from specjax.config import ConfigError, ModelConfig
from specjax.generate import Engine, GenerationError, GenerationOutput
from specjax.loading import Model, load_model
from specjax.model import ForwardOutput, causal_mask, forward, init_params
from specjax.sampling import SamplingConfig, SamplingError
from specjax import spec  # noqa: E402  (the step's pieces for a loop of your own)

__version__ = "0.1.0"

__all__ = [
    "CacheFullError", "ConfigError", "Engine", "ForwardOutput", "GenerationError",
    "GenerationOutput", "Model", "ModelConfig", "PageAllocator", "PagedKVCache",
    "SamplingConfig", "SamplingError", "causal_mask", "spec", "forward", "init_params", "load_model",
]
