"""Every `SPECJAX_*` environment variable (and `CXX`), declared once and read only here.

Each `Variable` has its name, the values it takes, its default and a one-line meaning (the table
in docs/architecture.md, "Settings", lists them); the modules that use a setting ask it here. The
process-wide choices read when functions are traced (`TraceSetting`: attention backend, CPU
matmul, draft weights) can be overridden inside `with` blocks (tests, debugging).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


class Variable:
    """An environment variable: `raw()` is its value as set ("" when unset)."""

    def __init__(self, name: str, values: str, default: str, meaning: str):
        self.name, self.values, self.default, self.meaning = name, values, default, meaning

    def raw(self) -> str:
        return os.environ.get(self.name, "")

    def value(self) -> str:
        """Its value as set, else its default."""
        return os.environ.get(self.name, self.default)


class TraceSetting(Variable):
    """A process-wide choice read when functions are traced: `get()` is the innermost `use(name)`
    block's name, else the variable's value, else choices[0]."""

    def __init__(self, name: str, choices: tuple[str, ...], what: str, meaning: str):
        super().__init__(name, ", ".join(choices), choices[0], meaning)
        self.choices, self.what = choices, what
        self._override: list[str] = []

    def check(self, name: str) -> str:
        if name not in self.choices:
            raise ValueError(f"{self.what} {name!r}: expected one of {', '.join(self.choices)}")
        return name

    def get(self) -> str:
        if self._override:
            return self._override[-1]
        return self.check(self.raw().strip().lower() or self.choices[0])

    @contextlib.contextmanager
    def use(self, name: str):
        """Force `name` inside the block. Functions jax.jit already traced keep the choice they
        were traced with, so JAX's caches are cleared on entry and exit."""
        import jax

        self._override.append(self.check(name))
        jax.clear_caches()
        try:
            yield
        finally:
            self._override.pop()
            jax.clear_caches()


ATTENTION = TraceSetting(
    "SPECJAX_ATTENTION",
    ("auto", "pallas", "pallas-interpret", "cpu", "xla"),
    "attention backend",
    "attention backend (`specjax.attention`): auto = the Pallas kernel on a CUDA GPU of sm80+, "
    "the native CPU kernel on one CPU device, the XLA reference elsewhere",
)
CPU_MATMUL = TraceSetting(
    "SPECJAX_CPU_MATMUL",
    ("auto", "kernel", "xla"),
    "CPU matmul setting",
    "few-row products on the native CPU kernel (`specjax.cpu.matmul`) or XLA's; auto = the "
    "kernel on one x86-64 CPU device where it builds (it also gates the other CPU kernels)",
)
DRAFT_WEIGHTS = TraceSetting(
    "SPECJAX_DRAFT_WEIGHTS",
    ("auto", "float32", "float16", "int8"),
    "draft weights setting",
    "the type draft networks' weights take on the CPU matmul kernel (`specjax.cpu.draft_weights`); auto = int8",
)
CACHE = Variable(
    "SPECJAX_CACHE",
    "a directory",
    "~/.cache/specjax",
    "root of specjax's cache: embedded models, converted GGUFs, built CPU kernels, compiled programs",
)
COMPILE_CACHE = Variable(
    "SPECJAX_COMPILE_CACHE",
    "a directory, or 0, off, false, no",
    "<SPECJAX_CACHE>/jax-compile",
    "JAX's persistent compilation cache for the `specjax` command (`specjax.compile_cache`); 0 turns it off",
)
DEBUG = Variable(
    "SPECJAX_DEBUG",
    "any non-empty value",
    "unset",
    "the `specjax` command raises errors with their traceback instead of printing one line",
)
EXAMPLES_SMOKE = Variable(
    "SPECJAX_EXAMPLES_SMOKE", "1", "unset", "examples/ run in their reduced mode (few tokens), as with --smoke"
)

API_KEY = Variable(
    "SPECJAX_API_KEY",
    "a string",
    "unset",
    "`specjax serve` answers /v1 requests only with `Authorization: Bearer <key>` (as --api-key)",
)

VARIABLES = (ATTENTION, CPU_MATMUL, DRAFT_WEIGHTS, CACHE, COMPILE_CACHE, DEBUG, EXAMPLES_SMOKE, API_KEY)
# Not specjax's own, but read here too: the compiler that builds the native CPU kernels.
CXX = Variable(
    "CXX", "a C++ compiler command", "g++", "the compiler that builds the native CPU kernels (`specjax.cpu.native`)"
)


def cache_dir() -> Path:
    """Root of specjax's cache: `$SPECJAX_CACHE` if set, else `~/.cache/specjax`."""
    env = CACHE.raw()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specjax"


def compiler() -> str:
    """$CXX, else g++."""
    return CXX.value()


def compile_cache_setting() -> str:
    """$SPECJAX_COMPILE_CACHE, stripped ("" when unset)."""
    return COMPILE_CACHE.raw().strip()


def debug() -> bool:
    """Whether $SPECJAX_DEBUG is set (to anything non-empty)."""
    return bool(DEBUG.raw())


def api_key() -> str | None:
    """$SPECJAX_API_KEY, or None when unset or empty."""
    return API_KEY.raw() or None


def examples_smoke() -> bool:
    """Whether $SPECJAX_EXAMPLES_SMOKE is 1."""
    return EXAMPLES_SMOKE.raw() == "1"
