"""specjax: speculative decoding for LLMs as pure JAX functions."""

from specjax import step_pieces
from specjax.cache import CacheFullError, PageAllocator, PagedKVCache
from specjax.generate import Engine, GenerationError, GenerationOutput
from specjax.loading import Model, load_model
from specjax.model import ForwardOutput, causal_mask, forward, init_params
from specjax.model_config import ConfigError, ModelConfig
from specjax.sampling import SamplingConfig, SamplingError

__version__ = "0.1.0"

__all__ = [
    "CacheFullError",
    "ConfigError",
    "Engine",
    "ForwardOutput",
    "GenerationError",
    "GenerationOutput",
    "Model",
    "ModelConfig",
    "PageAllocator",
    "PagedKVCache",
    "SamplingConfig",
    "SamplingError",
    "causal_mask",
    "step_pieces",
    "forward",
    "init_params",
    "load_model",
]
