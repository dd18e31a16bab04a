"""The memory the engine sizes its KV pool into (placement/device_memory.py): on GPU the smallest
of gpu_memory_utilization, the allocator's fraction it sets for JAX, and the 80% XLA:GPU plans
programs against; the fraction is set before JAX starts its GPU client, and a user's is kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.placement import device_memory
from jaxserve.placement.device_memory import plan, planning_fraction

GB = 10**9


def test_gpu_plans_into_the_smallest_of_utilization_allocator_and_xla_limit():
    assert planning_fraction("gpu", 0.9, allocator=0.9) == 0.8  # XLA:GPU's planning limit
    assert planning_fraction("gpu", 0.7, allocator=0.9) == 0.7
    assert planning_fraction("gpu", 0.9, allocator=0.6) == 0.6  # a user's smaller allocator
    assert planning_fraction("tpu", 0.9, allocator=0.6) == 0.9  # TPU has no such allocator


def test_a_gpu_reads_its_memory_off_the_allocators_limit(monkeypatch):
    for name in device_memory.FRACTION_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    assert plan("gpu", int(0.9 * 80 * GB), 0.9) == pytest.approx(0.8 * 80 * GB, abs=1)
    assert plan("gpu", int(0.9 * 80 * GB), 0.5) == pytest.approx(0.5 * 80 * GB, abs=1)
    assert plan("tpu", 16 * GB, 0.9) == int(0.9 * 16 * GB)


def _fraction_set(env: dict[str, str], code: str = "") -> str:
    script = ("import os; " + code + "from jaxserve.placement.device_memory import "
              "set_allocator_fraction; set_allocator_fraction(0.85); "
              "print(os.environ.get('XLA_CLIENT_MEM_FRACTION'), "
              "os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_the_engine_gives_jax_its_fraction_unless_a_user_did_or_jax_started():
    import os

    base = {k: v for k, v in os.environ.items() if k not in device_memory.FRACTION_VARS}
    base["JAX_PLATFORMS"] = "cpu"
    assert _fraction_set(base) == "0.85 None"
    assert _fraction_set(base | {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == "None 0.5"
    assert _fraction_set(base, "import jax; jax.devices(); ") == "None None"
