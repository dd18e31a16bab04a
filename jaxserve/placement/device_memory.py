"""How much of a device's memory the engine plans its weights, KV pool and step temporaries into,
on a device and deviceless alike.

- TPU: `gpu_memory_utilization` of the HBM the compiler plans against (the device's
  `bytes_limit`; deviceless, what libtpu reports: placement/targets.py).
- GPU: JAX's allocator takes XLA_CLIENT_MEM_FRACTION of the memory (jaxlib's default 0.75), and
  XLA:GPU plans a program against 80% of the device's memory, less its arguments
  (xla/service/gpu/gpu_hlo_schedule.cc: GetSchedulerMemoryLimit): arguments past that leave
  the scheduler no room and it says so. The engine sets the allocator's fraction to
  `gpu_memory_utilization` before JAX starts its GPU client, and plans into the smallest of the
  three.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jaxlib 0.10.2
DEFAULT_ALLOCATOR_FRACTION = 0.75
GPU_PLANNING_FRACTION = 0.80


def allocator_fraction(default: float = DEFAULT_ALLOCATOR_FRACTION) -> float:
    """The share of a GPU's memory JAX's allocator takes: the variable's, else `default` (JAX's
    own; deviceless, the engine's `gpu_memory_utilization`, which it will set)."""
    for name in FRACTION_VARS:
        if os.environ.get(name):
            return float(os.environ[name])
    return default


def set_allocator_fraction(utilization: float) -> None:
    """Give JAX's GPU allocator `utilization` of the memory, unless the user chose a fraction
    or JAX's backends are up already (then the fraction in force stays, and sizing reads it).
    Other platforms ignore the variable."""
    from jax._src import xla_bridge

    if any(os.environ.get(name) for name in FRACTION_VARS):
        return
    if xla_bridge.backends_are_initialized():
        logger.info("JAX's backends started before the engine: a GPU allocator keeps its "
                    "fraction (%.2f), which the KV pool is sized against",
                    DEFAULT_ALLOCATOR_FRACTION)
        return
    os.environ[FRACTION_VARS[0]] = f"{utilization:.4g}"


def planning_fraction(platform: str, utilization: float, allocator: float) -> float:
    """The share of the device's memory weights, KV pool and temporaries are sized into
    (`allocator`: the GPU allocator's share)."""
    return min(utilization, GPU_PLANNING_FRACTION, allocator) if platform == "gpu" else utilization


def plan(platform: str, bytes_limit: int, utilization: float) -> int:
    """On a device: the bytes to plan into, from its allocator's `bytes_limit` (on GPU the
    allocator's share of the memory), and the plan logged."""
    if platform != "gpu":
        logger.info("device memory: %.1f GiB; weights, KV pool and step temporaries are "
                    "planned into %.2f of it", bytes_limit / 2**30, utilization)
        return int(bytes_limit * utilization)
    allocator = allocator_fraction()
    memory = bytes_limit / allocator
    fraction = planning_fraction(platform, utilization, allocator)
    logger.info("GPU memory: %.1f GiB; JAX's allocator holds %.2f of it; weights, KV pool and "
                "step temporaries are planned into %.2f (gpu_memory_utilization %.2f, XLA:GPU "
                "plans programs against %.2f)", memory / 2**30, allocator, fraction,
                utilization, GPU_PLANNING_FRACTION)
    return int(memory * fraction)
