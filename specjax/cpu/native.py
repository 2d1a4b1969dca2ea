"""Native CPU kernels (`specjax/cpu/*.cc`): built with the machine's g++ on first use, cached
under `<specjax cache>/kernels`, and registered as XLA FFI custom calls.

`specjax.cpu.matmul` (few-row matrix products), `specjax.cpu.attention` (paged attention),
`specjax.cpu.activation` (an MLP's silu(gate) * up) and `specjax.cpu.top_k` (a draft's best
tokens) decide when to call them; this module only knows whether they can run here and builds
them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import jax

from specjax.settings import cache_dir, compiler

_DIR = Path(__file__).parent
SOURCES = tuple(sorted(_DIR.glob("*.cc")))
HEADERS = tuple(sorted(_DIR.glob("*.h")))
# FFI target name -> handler symbol in the library.
TARGETS = {
    "specjax_rows_matmul": "SpecjaxRowsMatmul",
    "specjax_rows_matmul_f16": "SpecjaxRowsMatmulF16",
    "specjax_rows_matmul_s8": "SpecjaxRowsMatmulS8",
    "specjax_paged_attention": "SpecjaxPagedAttention",
    "specjax_top_log_probs": "SpecjaxTopLogProbs",
    "specjax_swiglu": "SpecjaxSwiglu",
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def unsupported_reason() -> str | None:
    """Why the kernels cannot run here, or None when they can (they may still fail to build)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86-64 CPU is needed (this is {platform.machine()})"
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        return "the CPU lacks AVX2, FMA or F16C"
    if shutil.which(compiler()) is None:
        return "no C++ compiler (g++ or $CXX) to build it"
    return None


def library_path() -> Path:
    cxx = compiler()
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.name.encode() + source.read_bytes())
    key.update(" ".join([cxx, jax.__version__, *sorted(cpu_flags())]).encode())
    return cache_dir() / "kernels" / f"specjax_cpu-{key.hexdigest()[:16]}.so"


@lru_cache(maxsize=1)
def register() -> str | None:
    """Build (once per machine) and register every kernel; None on success, else why not."""
    reason = unsupported_reason()
    if reason is not None:
        return reason
    lib = library_path()
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        cmd = [
            compiler(),
            "-O3",
            "-march=native",
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-I",
            jax.ffi.include_dir(),
            *map(str, SOURCES),
            "-o",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            err = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"building {', '.join(s.name for s in SOURCES)} failed: {err}"
        os.replace(tmp, lib)
    handle = ctypes.cdll.LoadLibrary(str(lib))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
    return None
