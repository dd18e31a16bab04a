"""The TPU kernel's traffic model (`hbm_traffic` beside it, which the step's cost model reads)
against the DMAs the kernel really issues, counted in TPU interpret mode: every byte a DMA
copies from the cache into VMEM, or back. And what the traffic is: a prefill chunk reads its
prefix once (pages, and the last page up to its last tile), its new rows are written in whole
tiles and never read back."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from jaxserve.kernels.tpu.ragged_paged_attention import hbm_traffic, write_and_attend
from jaxserve.kernels.traffic import RaggedBatch

L, NB, BS, D, HKV, G = 2, 64, 16, 128, 2, 4
T, R, P = 48, 6, 12
PAGE_BYTES = 2 * BS * D * 2  # K and V, bf16


@contextmanager
def dma_bytes() -> Iterator[collections.Counter]:
    """Bytes each DMA copies under TPU interpret mode, by (source, destination) memory space."""
    tally: collections.Counter = collections.Counter()
    execute_read = tpu_interpreter.DMA.execute_read

    def counted(self):  # noqa: ANN001, ANN202
        execute_read(self)
        if self.data is not None:
            tally[self.src_memory_space, self.dst_memory_space] += self.data.nbytes

    tpu_interpreter.DMA.execute_read = counted
    try:
        yield tally
    finally:
        tpu_interpreter.DMA.execute_read = execute_read


def kernel_call(fn, *args) -> tuple[str, list[tuple[tuple[int, ...], int]]]:  # noqa: ANN001
    """The Pallas call's name and operands (dims, itemsize), as the compiled HLO shows them."""
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
              if e.primitive.name == "pallas_call"]
    return eqn.params["name"], [(tuple(v.aval.shape), v.aval.dtype.itemsize)
                                for v in eqn.invars]


def step(q_lens: list[int], kv_lens: list[int], seed: int = 0) -> tuple[jax.Array, ...]:
    """write_and_attend's arguments for these requests, each in blocks of its own."""
    rng = np.random.default_rng(seed)
    tables = np.zeros((R, P), np.int32)
    blocks = iter(rng.permutation(np.arange(1, NB)))
    for r, kv in enumerate(kv_lens):
        tables[r, :-(-kv // BS)] = [next(blocks) for _ in range(-(-kv // BS))]
    seq = np.zeros(R, np.int32)
    seq[:len(kv_lens)] = kv_lens
    qsl = np.full(R + 1, sum(q_lens), np.int32)
    qsl[:len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    return (normal(T, HKV * G, D), normal(T, HKV, D), normal(T, HKV, D),
            normal(L, HKV, NB, BS, D), normal(L, HKV, NB, BS, D), jnp.int32(1),
            jnp.asarray(seq), jnp.asarray(tables), jnp.asarray(qsl))


BATCHES = {
    "decodes": ([1, 1, 1, 1], [20, 33, 17, 64]),
    "chunk-after-prefix": ([1, 27, 1], [40, 150, 5]),
    "prefill-and-verify": ([24, 5, 1], [24, 50, 128]),
}


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("name", BATCHES)
def test_model_is_the_kernels_dma_count(name, window):
    q_lens, kv_lens = BATCHES[name]
    args = step(q_lens, kv_lens)

    def fn(*a: jax.Array) -> tuple[jax.Array, ...]:
        return write_and_attend(*a, sm_scale=0.1, sliding_window=window,
                                num_kv_pages_per_block=2, interpret=pltpu.InterpretParams())

    with dma_bytes() as tally:
        jax.block_until_ready(fn(*args))
    model = hbm_traffic(*kernel_call(fn, *args), RaggedBatch(tuple(q_lens), tuple(kv_lens)))
    hbm, vmem = (tpu_interpreter.TPU_MEMORY_SPACE_IDXS[space] for space in
                 (tpu_interpreter.mosaic_core.MemorySpace.HBM,
                  tpu_interpreter.mosaic_core.MemorySpace.VMEM))
    assert set(tally) == {(hbm, vmem), (vmem, hbm)}, tally
    assert (model.kv_read, model.kv_write) == (tally[hbm, vmem], tally[vmem, hbm])


def test_a_chunk_reads_its_prefix_once_and_writes_whole_new_tiles():
    prefix, chunk = 150, 27  # positions 150..176: from row 6 of page 9 to row 0 of page 11
    model = hbm_traffic(*kernel_call(
        lambda *a: write_and_attend(*a, sm_scale=0.1, num_kv_pages_per_block=2,
                                    interpret=True), *step([chunk], [prefix + chunk])),
        RaggedBatch((chunk,), (prefix + chunk,)))
    pages = -(-(prefix + chunk) // BS)
    assert model.kv_read == HKV * pages * PAGE_BYTES  # pages 0..11, each once
    assert model.kv_write == HKV * 3 * PAGE_BYTES  # the 16-row tiles 9, 10 and 11, whole
