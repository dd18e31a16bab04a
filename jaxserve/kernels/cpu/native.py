"""The native CPU kernel (paged_attention.cc), built into a library and registered as an
XLA FFI target.

The sources are compiled with the machine's C++ compiler on the first import of this module
(the project has no build hook of its own, and `-march=native` builds for the machine that
runs, not the one that installs), against the headers jaxlib ships. The library is cached
(`$JAXSERVE_KERNEL_CACHE`, default `~/.cache/jaxserve/kernels`) under a key hashed from the
sources, the flags, the compiler's identity (the first line of its `--version`), the jaxlib
version and the CPU's features; `$JAXSERVE_KERNEL_CXXFLAGS` adds flags (a sanitizer build, say).
`available()` says whether it built; callers fall back to XLA's own ops when it did not.

Builds, loads and prunes hold an exclusive lock on the cache folder, so two processes never
build at once. When a build lands, the builds of this kernel for the same CPU whose files are
older than it are removed: a process that loaded one keeps its mapping (removing a file does not
unmap it), and none can be between finding one and loading it, which happens under the lock.
Newer builds stay (another process's compiler or flags), as do other CPUs' in a shared cache."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

# FFI target -> the library's handler symbol
TARGETS = {"jaxserve_cpu_paged_attention": "JaxservePagedAttention"}
_DIR = Path(__file__).parent
_SOURCES = (_DIR / "paged_attention.cc",)
_HEADERS = (_DIR / "parallel_for.h", _DIR / "vector.h")
# Reassociation lets the compiler vectorise the dot products' sums. Not -ffast-math: linking
# with it adds crtfastmath, whose constructor turns on flush-to-zero and denormals-are-zero for
# the whole process once the library loads (numpy's and XLA's arithmetic included).
_FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_KERNEL_CACHE",
                               Path.home() / ".cache" / "jaxserve" / "kernels"))


def _extra_flags() -> tuple[str, ...]:
    return tuple(os.environ.get("JAXSERVE_KERNEL_CXXFLAGS", "").split())


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on this machine")
    return found


def _compiler_identity(cxx: str) -> bytes:
    """The first line of `cxx --version` ("g++ (Debian 12.2.0-14) 12.2.0"): an upgraded
    compiler behind the same path builds anew."""
    done = subprocess.run([cxx, "--version"], capture_output=True)
    return done.stdout.partition(b"\n")[0]


def _cpu_features() -> bytes:
    """The CPU's instruction sets (-march=native builds for them): a cache shared between
    machines keeps one library per kind of CPU."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cpu_kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _build(folder: Path, flags: Sequence[str]) -> Path:
    """The library for these flags in `folder`, compiled unless it is there; the caller holds
    the folder's lock."""
    cxx = compiler()
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in _SOURCES + _HEADERS),
                                     " ".join(flags).encode(), _compiler_identity(cxx),
                                     jaxlib.__version__.encode()])).hexdigest()[:16]
    cpu = hashlib.sha256(_cpu_features()).hexdigest()[:8]
    lib = folder / f"cpu_kernels-{cpu}-{key}.so"
    if lib.exists():
        return lib
    # Built beside its final name and renamed: a failed or killed build leaves no library.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", f"-I{_DIR}",
               *map(str, _SOURCES), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError(f"building the native CPU kernels failed: {' '.join(cmd)}\n"
                               + "\n".join(errors[:10]))
        os.replace(out, lib)
    built = lib.stat().st_mtime_ns
    for stale in folder.glob(f"cpu_kernels-{cpu}-*.so"):
        if stale != lib and stale.stat().st_mtime_ns < built:
            stale.unlink(missing_ok=True)
    return lib


def build(folder: Path, flags: Sequence[str] = ()) -> Path:
    """The library built with `flags` besides the usual ones into `folder` (cached there), not
    loaded."""
    with _locked(folder):
        return _build(folder, (*_FLAGS, *flags))


@functools.cache
def available() -> bool:
    """Builds (once per key and cache) and registers the kernels, on this module's import;
    False where they cannot be built."""
    folder = _cache_dir()
    try:
        with _locked(folder):
            lib = ctypes.cdll.LoadLibrary(str(_build(folder, (*_FLAGS, *_extra_flags()))))
    except (OSError, RuntimeError) as e:
        logger.warning("the native CPU kernels are unavailable, using XLA's ops: %s", e)
        return False
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True


available()  # not later, inside a model's construction: see the module's docstring
