"""Pallas kernels for jaxserve's attention: ragged paged attention for TPU (Mosaic, with the
step's KV write fused in) and GPU (Triton), beside the pure-JAX `xla` backend (xla_attention.py),
the CPU's native kernel (C++ through the XLA FFI, built by cpu_native.py: the `cpu` backend's
ragged paged attention, cpu_paged_attention.py),
and the plain numpy oracle every one of them is checked against (oracle.py). Importable
without jaxserve, and without libtpu or a GPU (the kernels only need one to compile, not to
import or to run interpreted)."""

import importlib
from typing import Any

# name -> (module, its name there); imported on first use: the TPU and GPU kernels pull in
# Pallas's Mosaic and Triton lowerings (~0.2 s), which a CPU engine never needs
_EXPORTS = {
    "default_gpu_tiles": ("tiling", "default_gpu_tiles"),
    "default_tpu_tiles": ("tiling", "default_tpu_tiles"),
    "ragged_paged_attention_gpu": ("ragged_paged_attention_gpu", "ragged_paged_attention"),
    "ragged_paged_attention_tpu": ("ragged_paged_attention_tpu", "ragged_paged_attention"),
    "ragged_paged_attention_xla": ("xla_attention", "ragged_paged_attention"),
    "validate_gpu_tiling": ("tiling", "validate_gpu_tiling"),
    "validate_tpu_tiling": ("tiling", "validate_tpu_tiling"),
    "write_kv": ("xla_attention", "write_kv"),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(f"pallas_kernels.{module}"), attr)


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
