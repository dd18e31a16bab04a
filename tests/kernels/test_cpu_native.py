"""Building the native CPU kernel: its cache key, the pruning of stale builds, one build at a
time, and the backend choice when it cannot be built. Most use a stand-in compiler that writes
its output file and counts its runs, so that no test waits for a real build; the real one is
built on the import of jaxserve.kernels.cpu.native. Its numerics are checked elsewhere: with the
other kernels (test_xla_attention.py against the oracle, test_ragged_paged_attention.py against
the `xla` backend, bf16 caches and poisoned KV included), its FFI entry in
test_cpu_paged_attention_ffi.py, under the sanitizers in test_cpu_native_sanitized.py, and in
every CPU engine test, whose default backend it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.kernels.cpu import native as cpu_native
from jaxserve.layers.attention import get_attention_backend

REPO_ROOT = Path(__file__).resolve().parents[2]

# `--version` prints "fakecc $FAKECC_VERSION"; a build appends a line to $FAKECC_LOG, takes
# $FAKECC_SECONDS, and writes the file after -o.
FAKE_COMPILER = """#!/bin/sh
if [ "$1" = --version ]; then echo "fakecc $FAKECC_VERSION"; exit 0; fi
echo build >> "$FAKECC_LOG"
sleep "${FAKECC_SECONDS:-0}"
while [ "$#" -gt 1 ]; do [ "$1" = -o ] && echo library > "$2"; shift; done
"""


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch) -> Path:
    """$CXX: the stand-in compiler, version 1; returns the log of its builds."""
    cxx = tmp_path / "fakecc"
    cxx.write_text(FAKE_COMPILER)
    cxx.chmod(0o755)
    log = tmp_path / "builds.log"
    log.touch()
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("FAKECC_VERSION", "1")
    monkeypatch.setenv("FAKECC_LOG", str(log))
    return log


def test_a_failed_build_raises_with_the_command_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="building the native CPU kernels failed: false "):
        cpu_native.build(tmp_path)
    assert not list(tmp_path.rglob("*.so"))


def test_a_build_is_cached_by_source_flags_and_compiler_version(tmp_path, fake_compiler,
                                                                monkeypatch):
    cache = tmp_path / "cache"
    lib = cpu_native.build(cache)
    assert lib.parent == cache and lib.stat().st_size > 0
    mtime = lib.stat().st_mtime_ns
    assert cpu_native.build(cache) == lib and lib.stat().st_mtime_ns == mtime
    assert len(fake_compiler.read_text().splitlines()) == 1
    monkeypatch.setenv("FAKECC_VERSION", "2")  # an upgraded compiler behind the same path
    upgraded = cpu_native.build(cache)
    with_flag = cpu_native.build(cache, ("-DNDEBUG",))
    source = tmp_path / "paged_attention.cc"
    source.write_bytes(cpu_native._SOURCES[0].read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(cpu_native, "_SOURCES", (source,))
    edited = cpu_native.build(cache)
    assert len({lib, upgraded, with_flag, edited}) == 4
    assert len(fake_compiler.read_text().splitlines()) == 4


def test_a_new_build_removes_only_older_builds_for_the_same_cpu(tmp_path, fake_compiler,
                                                               monkeypatch):
    cache = tmp_path / "cache"
    old = cpu_native.build(cache)
    cpu = old.name.split("-")[1]
    newer = cache / f"cpu_kernels-{cpu}-{'f' * 16}.so"  # another process's, built later
    other_cpu = cache / f"cpu_kernels-{'0' * 8}-{'f' * 16}.so"  # a shared cache's
    for path, age in ((old, 20), (newer, -20), (other_cpu, 20)):
        path.write_text("library")
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age))
    monkeypatch.setenv("FAKECC_VERSION", "2")
    current = cpu_native.build(cache)
    assert sorted(cache.glob("*.so")) == sorted([current, newer, other_cpu])


def test_processes_importing_the_module_at_once_build_it_once(tmp_path, fake_compiler):
    """The first import builds under the cache's lock: the second process waits for the first
    build and loads it rather than compiling again. (The stand-in's output is no library, so
    each then falls back to XLA's ops.)"""
    env = {**os.environ, "JAXSERVE_KERNEL_CACHE": str(tmp_path / "cache"), "FAKECC_SECONDS": "2",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "from jaxserve.kernels.cpu import native; assert not native.available()"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert fake_compiler.read_text().splitlines() == ["build"]
    assert len(list((tmp_path / "cache").glob("*.so"))) == 1


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """A library linked with -ffast-math sets flush-to-zero / denormals-are-zero for the whole
    process when it loads: subnormals would then read as zero everywhere."""
    assert cpu_native.available()
    tiny = np.float32(1e-40)  # subnormal; under DAZ it reads as 0 (compared with itself too)
    assert float(tiny * np.float32(2.0)) > 0.0


def test_without_the_native_kernel_auto_is_xla_and_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert get_attention_backend("auto", "cpu").name == "xla"
    with pytest.raises(ValueError, match="attention_backend .cpu. needs its native kernels"):
        get_attention_backend("cpu", "cpu")
