"""Compile targets without the chips: TPU topologies (libtpu) and GPU descriptions (the CUDA
compile-only plugin), as compile-only devices, the memory each one has and the chip's published
figures the step's cost model divides by."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Chip:
    """One JAX device's share of a chip's published figures (a TPU7x chip is two devices)."""
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense, per second
    link_bandwidth: float  # bytes/s one way over one ICI port (GPUs: the NVLink fabric's)
    ports: int  # ICI ports a device drives at once (GPUs: 1, the switch)
    collective_latency: float  # seconds per collective step between neighbours (an estimate)
    source: str

    def collective_seconds(self, nbytes: float, steps: int, links: int) -> float:
        """A collective that sends `nbytes` from each device over `links` ports at once, in
        `steps` steps between neighbours."""
        return nbytes / (min(links, self.ports) * self.link_bandwidth) + \
            steps * self.collective_latency


# Per device. TPU figures: Google Cloud's TPU pages (the chip's, divided by the devices on it);
# jax's own table (jax/_src/pallas/mosaic/tpu_info.py) agrees. A port's one-way bandwidth is the
# chip's bidirectional ICI figure over its ports, halved. The latency per ring step (~2 us: an
# all-gather of 32 kB shards over 4 v5e chips measured ~8 us in 3 steps, jax-ml.github.io/
# scaling-book/sharding) is to be measured on a lent chip.
CHIPS = {
    "TPU v5 lite": Chip(819e9, 197e12, 400e9 / 4 / 2, 4, 2e-6,
                        "cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 819 GBps HBM, "
                        "400 GBps bidirectional ICI per chip over 4 ports"),
    "TPU v6 lite": Chip(1638e9, 918e12, 800e9 / 4 / 2, 4, 2e-6,
                        "cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 1638 GBps HBM, "
                        "800 GBps bidirectional ICI per chip over 4 ports"),
    "TPU v5": Chip(2765e9, 459e12, 1200e9 / 6 / 2, 6, 2e-6,
                   "cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 2765 GBps HBM, "
                   "1200 GBps bidirectional ICI per chip over 6 ports (one device per chip, "
                   "megacore)"),
    "TPU7x": Chip(7380e9 / 2, 2307e12 / 2, 1200e9 / 4 / 2, 2, 2e-6,
                  "cloud.google.com/tpu/docs/tpu7x: 2307 TFLOPs bf16, 7380 GBps HBM, "
                  "1200 GBps bidirectional ICI per chip; two devices per chip, each taken to "
                  "drive 2 of 4 ports (the port count is not published)"),
    "NVIDIA H100 80GB HBM3": Chip(3.35e12, 989e12, 900e9 / 2, 1, 2e-6,
                                  "nvidia.com/en-us/data-center/h100 (SXM): 989 TFLOPS bf16 "
                                  "dense, 3.35 TB/s HBM3, 900 GB/s NVLink"),
    "NVIDIA H200": Chip(4.8e12, 989e12, 900e9 / 2, 1, 2e-6,
                        "nvidia.com/en-us/data-center/h200 (SXM): 989 TFLOPS bf16 dense, "
                        "4.8 TB/s HBM3e, 900 GB/s NVLink"),
}


@dataclass(frozen=True)
class Target:
    name: str  # "v5e:2x2", or the GPU description's file stem
    platform: str  # "tpu" | "gpu"
    device_kind: str
    devices: tuple[Any, ...]  # compile-only devices
    hbm_bytes: int  # per device, as the target's compiler plans against it

    @property
    def chip(self) -> Chip:
        chip = chip_of(self.device_kind)
        if chip is None:
            raise ValueError(f"no published figures for {self.device_kind!r}; known: "
                             f"{sorted(CHIPS)}")
        return chip


def chip_of(device_kind: str) -> Chip | None:
    """The published figures of a device kind (None: a CPU, or a chip not in the table)."""
    return next((chip for kind, chip in CHIPS.items() if device_kind.startswith(kind)), None)


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
    return Target(spec, "tpu", devices[0].device_kind, devices, tpu_hbm_bytes(devices[0]))


_AVAILABLE_HBM = re.compile(r"available HBM \(([0-9.]+)([KMGT])\)")


@functools.cache
def tpu_hbm_bytes(device: Any) -> int:
    """The HBM libtpu plans a program of this device against (16 GiB v5e: 15.75 GiB). A
    compile-only device reports no memory stats, so this asks the compiler: its refusal of a
    program that needs more memory than any chip has names what is available."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array([device]), ("x",))
    huge = jax.ShapeDtypeStruct((1 << 38,), jnp.float32, sharding=NamedSharding(mesh, P()))
    try:
        jax.jit(lambda x: x + 1).trace(huge).lower().compile()
    except Exception as e:  # noqa: BLE001 - the refusal is the answer
        found = _AVAILABLE_HBM.search(str(e))
        if found:
            return int(float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024)
        raise ValueError(f"libtpu did not report the HBM of {device.device_kind!r}: "
                         f"{str(e)[:300]}") from None
    raise ValueError(f"libtpu compiled a 1 TiB program for {device.device_kind!r}")
