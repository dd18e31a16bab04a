"""Attention metadata for one ragged step, and the attention backends behind one interface."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.kernels.cpu import native as cpu_native, paged_attention as cpu_paged_attention
from jaxserve.kernels.xla import attention as xla_attention
from jaxserve.layers.axes import AXIS

BACKENDS = ("auto", "xla", "cpu", "pallas", "pallas_interpret")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "slot_mapping", "query_start_loc", "seq_lens",
                                "block_tables"],
                   meta_fields=[])
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # i32[T_padded]
    # i32[T_padded]  block_id * block_size + offset; padding -> 0 (the null block)
    slot_mapping: jax.Array
    query_start_loc: jax.Array  # i32[R_padded + 1]  padding requests are empty
    seq_lens: jax.Array  # i32[R_padded]  tokens in the KV cache after this step
    block_tables: jax.Array  # i32[R_padded, max_blocks_per_seq]


AttendFn = Callable[..., jax.Array]
# (q, k, v, k_cache, v_cache, layer, seq_lens, block_tables, query_start_loc, **kwargs)
# -> (o, k_cache, v_cache)
FusedFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


@dataclass(frozen=True)
class AttentionBackend:
    """`write_and_attend(q, k, v, k_cache, v_cache, layer, md, sm_scale=, sliding_window=,
    soft_cap=)`: the step's new KV into the cache, then attention over it.

    On TPU one Pallas kernel does both (`fused`): it writes the new rows in whole tiles from
    the blocks it reads for attention, in place (XLA's scatter would copy the whole cache into
    a layout of its own and back). Elsewhere XLA's scatter writes the whole batch's KV, then
    the kernel reads it. No request reads KV another request writes in the same step: a prefix
    becomes hittable only once the step writing it is launched (core/kv_cache_manager.py).
    Pallas kernels cannot be partitioned by XLA, so under tensor parallelism they run per
    device in a `shard_map` over heads; the `xla` backend is left to the SPMD partitioner."""
    name: str
    kernel: AttendFn
    mesh: Mesh | None = None
    fused: FusedFn | None = None

    def _per_device(self, is_kernel: bool) -> bool:
        return is_kernel and self.mesh is not None and self.mesh.shape[AXIS] > 1

    def without_drafts(self) -> AttentionBackend:
        """The backend of a step that verifies no drafts, whose decodes are one row each: the
        program the engine runs without speculation (the `xla` backend's decode path has room
        for the drafts' rows otherwise)."""
        if self.name == "xla":
            return replace(self, kernel=_xla_kernel(1))
        return self

    def write_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                         v_cache: jax.Array, layer: int | jax.Array, md: AttentionMetadata,
                         **kwargs: object) -> tuple[jax.Array, jax.Array, jax.Array]:
        if self.fused is None:  # padding tokens write the null block
            k_cache, v_cache = xla_attention.write_kv(k_cache, v_cache, layer, k, v,
                                                      md.slot_mapping)
            return self.attend(q, k_cache, v_cache, layer, md, **kwargs), k_cache, v_cache

        def fused(q, k, v, k_cache, v_cache, layer, seq_lens, block_tables, query_start_loc):
            return self.fused(q, k, v, k_cache, v_cache, layer, seq_lens, block_tables,
                              query_start_loc, **kwargs)

        args = (q, k, v, k_cache, v_cache, layer, md.seq_lens, md.block_tables,
                md.query_start_loc)
        if not self._per_device(True):
            return fused(*args)
        heads, cache = P(None, AXIS, None), P(None, AXIS)
        return jax.shard_map(fused, mesh=self.mesh,
                             in_specs=(heads, heads, heads, cache, cache, P(), P(), P(), P()),
                             out_specs=(heads, cache, cache), check_vma=False)(
            *args[:5], jnp.asarray(layer, jnp.int32), *args[6:])

    def attend(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int | jax.Array,
               md: AttentionMetadata, **kwargs: object) -> jax.Array:
        def kernel(q, k_cache, v_cache, layer, seq_lens, block_tables, query_start_loc):
            return self.kernel(q, k_cache, v_cache, layer, seq_lens, block_tables,
                               query_start_loc, **kwargs)

        args = (q, k_cache, v_cache, layer, md.seq_lens, md.block_tables, md.query_start_loc)
        if not self._per_device(self.name != "xla"):
            return kernel(*args)
        args = (q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), *args[4:])  # arrays only
        heads, cache = P(None, AXIS, None), P(None, AXIS)
        return jax.shard_map(kernel, mesh=self.mesh,
                             in_specs=(heads, cache, cache, P(), P(), P(), P()),
                             out_specs=heads, check_vma=False)(*args)


@functools.cache
def _xla_kernel(decode_rows: int) -> AttendFn:
    # Cached so equal backends are one object: the jitted step's cache is keyed on it.
    return functools.partial(xla_attention.ragged_paged_attention, decode_rows=decode_rows)


@functools.cache
def _pallas_kernels(kind: str, interpret: bool) -> tuple[AttendFn, FusedFn | None]:
    # Cached so equal backends are one object: the jitted step's cache is keyed on it.
    from jaxserve.kernels.gpu.ragged_paged_attention import ragged_paged_attention as gpu_attend
    from jaxserve.kernels.tpu.ragged_paged_attention import (ragged_paged_attention as tpu_attend,
                                                             write_and_attend)

    if kind == "gpu":  # XLA:GPU scatters into the cache in place, row by row
        return functools.partial(gpu_attend, interpret=interpret), None
    return (functools.partial(tpu_attend, interpret=interpret),
            functools.partial(write_and_attend, interpret=interpret))


def get_attention_backend(name: str, platform: str | None = None, mesh: Mesh | None = None,
                          decode_rows: int = 1) -> AttentionBackend:
    """`auto` is the Pallas kernel on TPU and GPU, and on CPU `cpu` where its native kernels
    build, else `xla`. `cpu` is a native C++ kernel (compiled on first import), the dense layers
    XLA's dots either way: on an AVX2 EPYC whole engines ran decode-heavy work 14-17% faster on
    `cpu`, prefill-heavy 10% faster to 18% slower (results/bench_cpu_kernels_after_matmul.md).
    `pallas_interpret` runs the TPU
    kernel's program in Pallas interpret mode (any platform, for tests). `decode_rows`: the
    `xla` backend's decode path takes requests of up to this many query rows (1 + the
    speculative tokens, so a verifying decode shares its pages across its rows); the other
    kernels tile any query length alike."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    platform = platform or jax.default_backend()
    if name == "auto" and platform in ("tpu", "gpu", "cuda", "rocm"):
        name = "pallas"
    elif name == "auto":
        name = "cpu" if cpu_native.available() else "xla"
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only, this is {platform!r}")
    if name == "cpu" and not cpu_native.available():
        raise ValueError("attention_backend 'cpu' needs its native kernels, which did not build "
                         "here (a C++ compiler is required; see the log); use 'xla'")
    if name == "cpu":
        return AttentionBackend(name, cpu_paged_attention.ragged_paged_attention, mesh)
    if name == "xla":
        return AttentionBackend(name, _xla_kernel(decode_rows), mesh)
    if name == "pallas" and platform not in ("tpu", "gpu", "cuda", "rocm"):
        raise ValueError(f"attention_backend 'pallas' needs a TPU or GPU, this is {platform!r}; "
                         "use 'pallas_interpret' or 'xla'")
    kind = "tpu" if name == "pallas_interpret" or platform == "tpu" else "gpu"
    kernel, fused = _pallas_kernels(kind, name == "pallas_interpret")
    return AttentionBackend(name, kernel, mesh, fused=fused)


def validate_backend(backend: AttentionBackend, *, platform: str, num_q_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int, max_num_seqs: int,
                     pages_per_seq: int, max_num_tokens: int, dtype: str) -> None:
    """Check block size and kernel tiles against the hardware at start-up (ValueError)."""
    if backend.name != "pallas":
        return
    import jaxserve.kernels as pk

    group = num_q_heads // num_kv_heads
    if platform == "tpu":
        pages, sub_rows = pk.default_tpu_tiles(block_size=block_size)
        pk.validate_tpu_tiling(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, block_size=block_size,
                               max_num_seqs=max_num_seqs, pages_per_seq=pages_per_seq,
                               num_kv_pages_per_block=pages, sub_rows=sub_rows,
                               num_tokens=max_num_tokens, q_dtype=dtype, kv_dtype=dtype)
    else:
        pages, queries = pk.default_gpu_tiles(group=group, block_size=block_size,
                                              num_tokens=max_num_tokens, num_reqs=max_num_seqs)
        pk.validate_gpu_tiling(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, block_size=block_size,
                               num_kv_pages_per_block=pages, num_queries_per_block=queries)
