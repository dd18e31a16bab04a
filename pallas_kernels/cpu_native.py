"""The native CPU kernel (cpu_paged_attention.cc), built into a library and registered as an
XLA FFI target.

The sources are compiled with the machine's C++ compiler on first use, against the headers
jaxlib ships, and cached by the hash of sources, flags, compiler, jaxlib version and CPU
features (`$JAXSERVE_KERNEL_CACHE`, default `~/.cache/jaxserve/kernels`). `available()` says
whether they built; callers fall back to XLA's own ops when they did not."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

# FFI target -> the library's handler symbol
TARGETS = {"jaxserve_cpu_paged_attention": "JaxservePagedAttention"}
_DIR = Path(__file__).parent
_SOURCES = (_DIR / "cpu_paged_attention.cc",)
_HEADERS = (_DIR / "cpu_parallel_for.h", _DIR / "cpu_vector.h")
# Reassociation lets the compiler vectorise the dot products' sums. Not -ffast-math: linking
# with it adds crtfastmath, whose constructor turns on flush-to-zero and denormals-are-zero for
# the whole process once the library loads (numpy's and XLA's arithmetic included).
_FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_KERNEL_CACHE",
                               Path.home() / ".cache" / "jaxserve" / "kernels"))


def _cpu_features() -> bytes:
    """The CPU's instruction sets (-march=native builds for them): a cache shared between
    machines keeps one library per kind of CPU."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on this machine")
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in _SOURCES + _HEADERS),
                                     " ".join(_FLAGS).encode(), compiler.encode(),
                                     jaxlib.__version__.encode(), _cpu_features()]))
    lib = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent builders (test workers) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{_DIR}",
               *map(str, _SOURCES), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError(f"building the native CPU kernels failed: {' '.join(cmd)}\n"
                               + "\n".join(errors[:10]))
        os.replace(out, lib)
    return lib


@functools.cache
def available() -> bool:
    """Builds (once per source and machine) and registers the kernels; False where they
    cannot be built."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, RuntimeError) as e:
        logger.warning("the native CPU kernels are unavailable, using XLA's ops: %s", e)
        return False
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True
