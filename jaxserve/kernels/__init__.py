"""jaxserve's attention kernels, one folder a family: ragged paged attention for TPU (tpu/:
Pallas Mosaic, with the step's KV write fused in) and GPU (gpu/: Pallas Triton), the pure-JAX
`xla` backend (xla/), the CPU's native kernel (cpu/: C++ through the XLA FFI, built by
cpu/native.py), and beside them the schedule, tiling and traffic model they share and the plain
numpy oracle every one of them is checked against (oracle.py). Importable without libtpu or a
GPU: the kernels need one to compile, not to import or to run interpreted."""

from jaxserve.kernels.gpu.ragged_paged_attention import (
    ragged_paged_attention as ragged_paged_attention_gpu,
)
from jaxserve.kernels.tiling import (
    default_gpu_tiles,
    default_tpu_tiles,
    validate_gpu_tiling,
    validate_tpu_tiling,
)
from jaxserve.kernels.tpu.ragged_paged_attention import (
    ragged_paged_attention as ragged_paged_attention_tpu,
)
from jaxserve.kernels.xla.attention import ragged_paged_attention as ragged_paged_attention_xla
from jaxserve.kernels.xla.attention import write_kv

__all__ = [
    "default_gpu_tiles",
    "default_tpu_tiles",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_xla",
    "validate_gpu_tiling",
    "validate_tpu_tiling",
    "write_kv",
]
