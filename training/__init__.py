"""Training of draft heads (Medusa, EAGLE, ...) for a base model.

`specjax.training.train.run(TrainConfig(...))` runs the whole pipeline; `specjax train` and
`python -m specjax.training` are its command line. Submodules load lazily, so `specjax generate`
does not pay for optax and orbax.
"""

import importlib

_EXPORTS = {
    "DataError": "specjax.training.data",
    "PromptRecord": "specjax.training.data",
    "read_prompt_file": "specjax.training.data",
    "METHODS": "specjax.training.trainers",
    "make_method": "specjax.training.trainers",
    "TrainConfig": "specjax.training.train",
    "TrainError": "specjax.training.train",
    "run": "specjax.training.train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specjax.training' has no attribute {name!r}")
