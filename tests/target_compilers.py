"""The environment for running a TPU or GPU target's compiler (libtpu, the CUDA compile-only
plugin) in a subprocess: the CPU-only XLA flags the test run sets for itself are taken out, so
what the target's compiler reports is what it reports outside the tests."""

from __future__ import annotations

import os

CPU_TEST_XLA_FLAGS = ("--xla_force_host_platform_device_count=8",
                      "--xla_backend_optimization_level=0")


def target_compiler_env(**extra: str) -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in CPU_TEST_XLA_FLAGS]
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", **extra)
