"""A process-wide choice read when functions are traced: an environment variable, overridable
inside `with` blocks (tests, debugging). Used for the attention backend and the CPU matmul."""

from __future__ import annotations

import contextlib
import os

import jax


class TraceSetting:
    """`get()` is the innermost `use(name)` block's name, else $env_var, else choices[0]."""

    def __init__(self, env_var: str, choices: tuple[str, ...], what: str):
        self.env_var, self.choices, self.what = env_var, choices, what
        self._override: list[str] = []

    def check(self, name: str) -> str:
        if name not in self.choices:
            raise ValueError(f"{self.what} {name!r}: expected one of {', '.join(self.choices)}")
        return name

    def get(self) -> str:
        if self._override:
            return self._override[-1]
        value = os.environ.get(self.env_var, "").strip().lower()
        return self.check(value or self.choices[0])

    @contextlib.contextmanager
    def use(self, name: str):
        """Force `name` inside the block. Functions jax.jit already traced keep the choice they
        were traced with, so JAX's caches are cleared on entry and exit."""
        self._override.append(self.check(name))
        jax.clear_caches()
        try:
            yield
        finally:
            self._override.pop()
            jax.clear_caches()
