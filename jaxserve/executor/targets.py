"""Compile targets without the chips: TPU topologies (libtpu) and GPU descriptions (the CUDA
compile-only plugin), as compile-only devices and the memory each one has."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import re
from typing import Any

# HBM per device (a TPU7x chip is two devices). Compile-only devices report no memory stats.
TPU_HBM_BYTES = {
    "TPU v4": 32 << 30,
    "TPU v5 lite": 16 << 30,
    "TPU v5": 95 << 30,
    "TPU v6 lite": 32 << 30,
    "TPU7x": 96 << 30,
}


@dataclass(frozen=True)
class Target:
    name: str  # "v5e:2x2", or the GPU description's file stem
    platform: str  # "tpu" | "gpu"
    device_kind: str
    devices: tuple[Any, ...]  # compile-only devices
    hbm_bytes: int  # per device


def resolve_target(spec: str) -> Target:
    """A TPU topology name (`v5e:2x2`, `tpu7x:2x2x1`) or a GpuTargetConfigProto text file."""
    from jax.experimental import topologies

    if Path(spec).suffix in (".txtpb", ".pbtxt", ".txt"):
        text = Path(spec).read_text()
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=text)
        memory = re.search(r"device_memory_size:\s*(\d+)", text)
        if memory is None:
            raise ValueError(f"{spec}: no device_memory_size in the GPU description")
        devices = tuple(topo.devices)
        return Target(Path(spec).stem, "gpu", devices[0].device_kind, devices,
                      int(memory.group(1)))
    try:
        topo = topologies.get_topology_desc(spec, "tpu")
    except Exception as e:  # noqa: BLE001 - libtpu's errors are RuntimeErrors of many kinds
        raise ValueError(f"target {spec!r} is not a TPU topology libtpu knows (e.g. v5e:2x2, "
                         f"v6e:2x2, v5p:2x2x1, tpu7x:2x2x1) nor a GPU description file: {e}"
                         ) from None
    devices = tuple(topo.devices)
    kind = devices[0].device_kind
    if kind not in TPU_HBM_BYTES:
        raise ValueError(f"no HBM size known for {kind!r}; known: {sorted(TPU_HBM_BYTES)}")
    return Target(spec, "tpu", kind, devices, TPU_HBM_BYTES[kind])
