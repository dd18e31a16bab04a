"""Deviceless TPU compile of the ragged paged-attention kernel (libtpu: .venv-tpu, made by
scripts/setup_compile_venvs.sh tpu).

Runs the real XLA:TPU + Mosaic compiler on the CPU host against compile-only TPU topologies, for the
full mixed prefill/decode call (the KV write fused in, as the engine runs it) in float32 and
bfloat16, and checks that configurations our tiling check refuses are rejected by the toolchain
too (so this check can fail).

    PYTHONPATH=. .venv-tpu/bin/python scripts/check_tpu_compile.py [--topologies v5e:2x2 v6e:2x2]

Prints one line per case and exits non-zero if a good case fails or the bad case compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.kernels.tpu.ragged_paged_attention import write_and_attend


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    head_dim: int = 128
    num_q_heads: int = 8
    num_kv_heads: int = 2
    block_size: int = 16
    num_tokens: int = 128  # a mixed step: prefill chunks and decodes
    max_num_seqs: int = 32
    pages_per_seq: int = 64
    num_blocks: int = 2048
    sliding_window: int | None = None
    soft_cap: float | None = None
    tiles: tuple[tuple[str, int], ...] = ()  # explicit tile kwargs
    validate: bool = True


GOOD = [
    Case("mixed-f32", "float32"),
    Case("mixed-bf16", "bfloat16"),
    Case("mixed-f32-d64-window-softcap", "float32", head_dim=64, num_q_heads=4, num_kv_heads=4,
         sliding_window=128, soft_cap=30.0),
    Case("mixed-bf16-bs128-gqa4", "bfloat16", num_q_heads=8, block_size=128, pages_per_seq=16,
         tiles=(("num_kv_pages_per_block", 2), ("sub_rows", 256))),
]
# Each bad case is first refused by our tiling check, then compiled anyway (validate=False) to show
# that the TPU toolchain itself rejects it.
BAD = [
    # 16384 tokens x 4 query heads: one head's rows, their f32 state and the new-row tiles need
    # ~190 MiB of VMEM, over every TPU's (64-128 MiB).
    Case("rows-over-vmem", "float32", num_tokens=16384, max_num_seqs=64),
    # 256 x 2048 int32 block table = 2 MiB of scalar prefetch, over the 1 MiB SMEM (XLA:TPU).
    Case("block-table-over-smem", "float32", max_num_seqs=256, pages_per_seq=2048, num_blocks=256),
]


def compile_case(case: Case, topology: str) -> float:
    topo = topologies.get_topology_desc(topology, "tpu")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    dt = jnp.dtype(case.dtype)
    L, NB = 4, case.num_blocks

    def spec(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    cache = spec((L, case.num_kv_heads, NB, case.block_size, case.head_dim), dt)
    new = spec((case.num_tokens, case.num_kv_heads, case.head_dim), dt)
    args = (spec((case.num_tokens, case.num_q_heads, case.head_dim), dt), new, new, cache, cache,
            spec((), jnp.int32), spec((case.max_num_seqs,), jnp.int32),
            spec((case.max_num_seqs, case.pages_per_seq), jnp.int32),
            spec((case.max_num_seqs + 1,), jnp.int32))

    def fn(*a: jax.Array) -> tuple[jax.Array, ...]:
        return write_and_attend(*a, sm_scale=case.head_dim ** -0.5,
                                sliding_window=case.sliding_window, soft_cap=case.soft_cap,
                                validate=case.validate, **dict(case.tiles))

    start = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(fn, donate_argnums=(3, 4)).trace(*args).lower()
    lowered.compile()
    return time.perf_counter() - start


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:240] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", nargs="+", default=["v5e:2x2", "v6e:2x2"])
    opts = parser.parse_args()
    failures = 0
    for topology in opts.topologies:
        for case in GOOD:
            try:
                secs = compile_case(case, topology)
                print(f"OK       {topology} {case.name}: compiled in {secs:.2f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - report every failure, then fail at the end
                failures += 1
                print(f"FAILED   {topology} {case.name}: {type(e).__name__}: {_first_line(e)}",
                      flush=True)
        for case in BAD:
            try:
                compile_case(case, topology)
                failures += 1
                print(f"FAILED   {topology} {case.name}: passed the tiling check", flush=True)
                continue
            except ValueError as e:
                print(f"REFUSED  {topology} {case.name}: tiling check: {e}", flush=True)
            try:
                compile_case(dataclasses.replace(case, validate=False), topology)
                failures += 1
                print(f"FAILED   {topology} {case.name}: compiled but should be rejected",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - the toolchain's rejection is what we want
                print(f"REJECTED {topology} {case.name}: {type(e).__name__}: {_first_line(e)}",
                      flush=True)
    print("check_tpu_compile:", "FAIL" if failures else "PASS", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
