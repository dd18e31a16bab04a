"""Building the native CPU kernel, and the backend choice when it cannot be built. Its
numerics are checked elsewhere: with the other kernels (test_xla_attention.py against the
oracle, test_ragged_paged_attention.py against the `xla` backend, bf16 caches and poisoned KV
included), and in every CPU engine test, whose default backend it is."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.layers.attention import get_attention_backend
from pallas_kernels import cpu_native


def test_a_failed_build_raises_with_the_command_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="building the native CPU kernels failed: false "):
        cpu_native._build()
    assert not list(tmp_path.rglob("*.so"))


def test_a_build_is_cached_by_source_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    lib = cpu_native._build()
    assert lib.parent == tmp_path and lib.stat().st_size > 0
    mtime = lib.stat().st_mtime_ns
    assert cpu_native._build() == lib and lib.stat().st_mtime_ns == mtime


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
