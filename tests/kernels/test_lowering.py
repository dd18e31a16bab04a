"""On CPU: the TPU kernel lowers for TPU (abstract TPU device), the GPU kernel lowers for CUDA
through Triton, and tile configurations the hardware cannot take are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from jaxserve.kernels import (
    default_gpu_tiles,
    default_tpu_tiles,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
    validate_gpu_tiling,
    validate_tpu_tiling,
)

T, HQ, HKV, D, L, NB, BS, R, P = 64, 8, 2, 128, 2, 256, 16, 16, 32


def shapes(dtype: str, num_q_heads: int = HQ, num_kv_heads: int = HKV,
           head_dim: int = D) -> tuple[jax.ShapeDtypeStruct, ...]:
    cache = jax.ShapeDtypeStruct((L, num_kv_heads, NB, BS, head_dim), jnp.dtype(dtype))
    return (jax.ShapeDtypeStruct((T, num_q_heads, head_dim), jnp.dtype(dtype)), cache, cache,
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.int32),
            jax.ShapeDtypeStruct((R, P), jnp.int32), jax.ShapeDtypeStruct((R + 1,), jnp.int32))


def lower_for_tpu(device_kind: str, dtype: str, **kw: object) -> str:
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind=device_kind, num_cores=1, platform="tpu"))

    def fn(*a: jax.Array) -> jax.Array:
        return ragged_paged_attention_tpu(*a, sm_scale=D ** -0.5, **kw)

    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*shapes(dtype)).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"])
def test_tpu_kernel_lowers_to_a_mosaic_custom_call(device_kind: str, dtype: str) -> None:
    text = lower_for_tpu(device_kind, dtype, sliding_window=64, soft_cap=30.0)
    assert "tpu_custom_call" in text
    assert "ragged_paged_attention_tpu" in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernel_lowers_for_cuda_through_triton(dtype: str) -> None:
    def fn(*a: jax.Array) -> jax.Array:
        return ragged_paged_attention_gpu(*a, sm_scale=D ** -0.5, sliding_window=64, soft_cap=30.0)

    text = jax.jit(fn).trace(*shapes(dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "mosaic_gpu" not in text


def test_misaligned_sub_tiles_are_rejected_for_tpu() -> None:
    # A sub-tile's rows start at multiples of 8 (f32) or 16 (bf16): whole VMEM tiles.
    with pytest.raises(ValueError, match="sub_rows=12"):
        validate_tpu_tiling(num_q_heads=2, num_kv_heads=2, head_dim=128, block_size=16,
                            max_num_seqs=R, pages_per_seq=P, num_kv_pages_per_block=8,
                            sub_rows=12, num_tokens=T)
    with pytest.raises(ValueError, match="sub_rows=24"):
        lower_for_tpu("TPU v5 lite", "bfloat16", sub_rows=24)


def test_tpu_block_table_larger_than_smem_is_rejected() -> None:
    base = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                num_kv_pages_per_block=16, sub_rows=512, num_tokens=T)
    with pytest.raises(ValueError, match="max_num_seqs=256 x pages_per_seq=2048"):
        validate_tpu_tiling(max_num_seqs=256, pages_per_seq=2048, **base)
    validate_tpu_tiling(max_num_seqs=256, pages_per_seq=512, **base)


def test_tpu_steps_over_vmem_and_unaligned_pages_are_rejected() -> None:
    base = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, max_num_seqs=R, pages_per_seq=P,
                num_kv_pages_per_block=4, sub_rows=512, block_size=128, kv_dtype="bfloat16",
                q_dtype="bfloat16")
    validate_tpu_tiling(num_tokens=4096, **base)  # the v6e preset's largest step
    with pytest.raises(ValueError, match="num_tokens=16384"):
        validate_tpu_tiling(num_tokens=16384, **base)
    validate_tpu_tiling(num_tokens=16384, vmem_limit_bytes=256 << 20, **base)
    with pytest.raises(ValueError, match="block_size=8"):
        validate_tpu_tiling(num_tokens=T, **(base | {"block_size": 8}))


@pytest.mark.parametrize(("field", "overrides"), [
    ("head_dim", dict(head_dim=96)),
    ("block_size", dict(block_size=24)),
    ("num_kv_pages_per_block", dict(num_kv_pages_per_block=3)),
    ("num_queries_per_block", dict(num_queries_per_block=2)),  # 2 x 4 heads = 8 rows < 16
    ("num_q_heads", dict(num_q_heads=6, num_kv_heads=4)),
])
def test_gpu_tiles_triton_cannot_take_are_rejected(field: str, overrides: dict[str, int]) -> None:
    config = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                  num_kv_pages_per_block=4, num_queries_per_block=16) | overrides
    with pytest.raises(ValueError, match=field):
        validate_gpu_tiling(**config)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
def test_default_tiles_pass_their_own_checks(group: int, block_size: int, num_tokens: int) -> None:
    for dtype in ("float32", "bfloat16"):
        pages, sub_rows = default_tpu_tiles(block_size=block_size)
        validate_tpu_tiling(num_q_heads=2 * group, num_kv_heads=2, head_dim=128,
                            block_size=block_size, max_num_seqs=128, pages_per_seq=64,
                            num_kv_pages_per_block=pages, sub_rows=sub_rows,
                            num_tokens=num_tokens, q_dtype=dtype, kv_dtype=dtype)
    pages, queries = default_gpu_tiles(group=group, block_size=block_size, num_tokens=num_tokens)
    validate_gpu_tiling(num_q_heads=2 * group, num_kv_heads=2, head_dim=128,
                        block_size=block_size, num_kv_pages_per_block=pages,
                        num_queries_per_block=queries)
