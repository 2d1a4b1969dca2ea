"""JAX's persistent compilation cache for the `specjax` command.

A second `specjax generate` (or bench, train) with the same model and shapes loads its compiled
programs from disk instead of compiling them again, as vLLM and torch.compile keep theirs. Only the
command turns it on: library users keep their own JAX configuration.

`SPECJAX_COMPILE_CACHE` = a directory (default `<specjax cache>/jax-compile`), or `0` / `off` to
disable it. A cache directory the user already gave JAX (`JAX_COMPILATION_CACHE_DIR` or
`jax.config`) is left as it is. Nothing is evicted (JAX's size-capped mode cannot share a
directory with processes that run without the cap); a full test run adds tens of MB, and
deleting the directory is always safe.
"""

from __future__ import annotations

from pathlib import Path

from specjax.settings import cache_dir, compile_cache_setting

OFF = ("0", "off", "false", "no")
# Cache programs whose compilation took at least this long: most of a step's helpers compile in
# well under JAX's default second, yet add up to several seconds per run.
MIN_COMPILE_SECONDS = 0.1


def compile_cache_dir() -> Path | None:
    """Where the command caches compiled programs, or None when disabled."""
    setting = compile_cache_setting()
    if setting.lower() in OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    return cache_dir() / "jax-compile"


def enable_compile_cache() -> Path | None:
    """Point JAX's persistent cache at `compile_cache_dir()`; returns the directory in use."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    path = compile_cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path
