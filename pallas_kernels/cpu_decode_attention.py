"""The decode rows' paged attention on CPU as a native kernel (cpu_decode_attention.cc), called
through the XLA FFI. XLA:CPU runs the decode path's small batched dots at a few GB/s of KV; the
kernel reads each (request, KV head)'s pages once from the paged cache, for all of its rows.

The source is compiled with the machine's C++ compiler on first use, against the headers jaxlib
ships, and cached by the hash of source, flags, compiler, jaxlib version and CPU features
(`$JAXSERVE_KERNEL_CACHE`, default `~/.cache/jaxserve/kernels`). `available()` says whether it
built; callers fall back to the pure-JAX path when it did not."""

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
import jax.numpy as jnp
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jaxserve_cpu_decode_attention"
_SOURCE = Path(__file__).with_name("cpu_decode_attention.cc")
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
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(_FLAGS).encode(),
                                     compiler.encode(), jaxlib.__version__.encode(),
                                     _cpu_features()]))
    lib = _cache_dir() / f"cpu_decode_attention-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent builders (test workers) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError(f"building {_SOURCE.name} failed: {' '.join(cmd)}\n"
                               + "\n".join(errors[:10]))
        os.replace(out, lib)
    return lib


@functools.cache
def available() -> bool:
    """Builds (once per source and machine) and registers the kernel; False where it cannot."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, RuntimeError) as e:
        logger.warning("the native CPU decode attention is unavailable, using XLA's: %s", e)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveDecodeAttention),
                                platform="cpu")
    return True


def attend_decodes(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]  f32 or bf16
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    *,
    max_rows: int,  # requests of 1..max_rows query rows are decodes
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:  # [T, Hq, D]  the decodes' rows; zeros elsewhere
    if not available():
        raise RuntimeError("the native CPU decode attention did not build here (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
               seq_lens, block_tables, query_start_loc,
               sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
               window=np.int64(sliding_window or 0), max_rows=np.int64(max_rows))
    return out.astype(q.dtype)
