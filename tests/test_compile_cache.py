"""Where the `specjax` command keeps JAX's persistent compilation cache, and how it is turned off."""

from __future__ import annotations

import jax
import pytest

from specjax.compile_cache import compile_cache_dir, enable_compile_cache


@pytest.fixture
def jax_cache_config():
    """Restore JAX's cache settings after a test changes them."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_default_dir_is_under_the_specjax_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECJAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    assert compile_cache_dir() == tmp_path / "jax-compile"


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false"])
def test_disabled(monkeypatch, value, jax_cache_config):
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", value)
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache_dir() is None
    assert enable_compile_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


def test_enable_sets_jax_config(monkeypatch, tmp_path, jax_cache_config):
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", str(tmp_path / "c"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert enable_compile_cache() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")


def test_a_dir_the_user_gave_jax_is_kept(monkeypatch, tmp_path, jax_cache_config):
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", str(tmp_path / "ours"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert enable_compile_cache() == tmp_path / "theirs"
    assert not (tmp_path / "ours").exists()
