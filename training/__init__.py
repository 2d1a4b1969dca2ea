"""Training of draft heads (Medusa, EAGLE, ...) for a base model.

`training.train.run(TrainConfig(...))` runs the whole pipeline; `specjax train` and
`python -m training` are its command line. Submodules load lazily, so `specjax generate`
does not pay for optax and orbax.
"""

import importlib

_EXPORTS = {
    "DataError": "training.data", "PromptRecord": "training.data",
    "read_prompt_file": "training.data", "METHODS": "training.methods",
    "make_method": "training.methods", "TrainConfig": "training.train",
    "TrainError": "training.train", "run": "training.train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
