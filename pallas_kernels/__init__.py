"""Pallas kernels for jaxserve's attention: ragged paged attention for TPU (Mosaic, with the
step's KV write fused in) and GPU (Triton), beside the pure-JAX `xla` backend (xla_attention.py),
the CPU's native kernel (C++ through the XLA FFI, built by cpu_native.py: the `cpu` backend's
ragged paged attention, cpu_paged_attention.py),
and the plain numpy oracle every one of them is checked against (oracle.py). Importable
without jaxserve, and without libtpu or a GPU (the kernels only need one to compile, not to
import or to run interpreted)."""

from pallas_kernels.ragged_paged_attention_gpu import (
    ragged_paged_attention as ragged_paged_attention_gpu,
)
from pallas_kernels.ragged_paged_attention_tpu import (
    ragged_paged_attention as ragged_paged_attention_tpu,
)
from pallas_kernels.xla_attention import ragged_paged_attention as ragged_paged_attention_xla
from pallas_kernels.xla_attention import write_kv
from pallas_kernels.tiling import (
    default_gpu_tiles,
    default_tpu_tiles,
    validate_gpu_tiling,
    validate_tpu_tiling,
)

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
