"""Interpret-mode numerics of the TPU and GPU ragged paged-attention kernels, and the `cpu`
backend's native kernel, against the `xla` backend (jaxserve/kernels/xla/attention.py,
itself checked against the plain oracle); and the TPU kernel's fused KV write against the `xla`
backend's scatter, bit for bit.

Every (kernel, config) pair compiles once: shapes are fixed per config and hypothesis varies only
the data (query/KV lengths, which blocks are shared, padding). Tolerances, max |kernel - ref| over
the real query rows: float32 1e-5 (both compute in f32; seen: <= 2e-6); bfloat16 1.6e-2 absolute
+ 1e-2 relative, about two bf16 ulps of the O(1) outputs (the kernels feed bf16 q/k and bf16
probabilities to the matmuls, the reference works in f32 from the same bf16 inputs; seen: 7.8e-3).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxserve.kernels import (
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
    write_kv,
)
from jaxserve.kernels.cpu.paged_attention import (
    ragged_paged_attention as ragged_paged_attention_cpu,
)
from jaxserve.kernels.tpu.ragged_paged_attention import write_and_attend

NUM_TOKENS = 40  # padded T: real rows first, then rows that belong to no request
MAX_SEQS = 6  # padded R
PAGES_PER_SEQ = 8
BLOCK_SIZE = 16
NUM_BLOCKS = 56  # block 0 is the null block
NUM_LAYERS = 2
LAYER = 1
MAX_KV = PAGES_PER_SEQ * BLOCK_SIZE
TOLERANCE = {"float32": (1e-5, 0.0), "bfloat16": (1.6e-2, 1e-2)}  # (atol, rtol)

KERNELS: dict[str, Callable[..., jax.Array]] = {
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    "cpu": ragged_paged_attention_cpu}  # the `cpu` backend's native kernel


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    tpu_tiles: tuple[tuple[str, int], ...] = ()  # () -> the kernel's defaults
    gpu_tiles: tuple[tuple[str, int], ...] = ()


CONFIGS = {
    "f32-d64-g1": Config("float32", 64, 2, 2,
                         tpu_tiles=(("num_kv_pages_per_block", 2), ("sub_rows", 16)),
                         gpu_tiles=(("num_kv_pages_per_block", 1), ("num_queries_per_block", 16))),
    "f32-d128-g2-window": Config("float32", 128, 4, 2, sliding_window=24),
    "bf16-d128-g4-softcap": Config("bfloat16", 128, 4, 1, soft_cap=20.0,
                                   tpu_tiles=(("num_kv_pages_per_block", 4),),
                                   gpu_tiles=(("num_kv_pages_per_block", 2),
                                              ("num_queries_per_block", 4))),
    "bf16-d64-g2-window-softcap": Config("bfloat16", 64, 4, 2, sliding_window=40, soft_cap=10.0),
}

# The native CPU kernel's other head dims: 8 (stories260K's) transposes 16 keys into lanes, 16
# and 32 take its whole-vector path, 24 its generic one.
CPU_CONFIGS = {
    "f32-d8-g2": Config("float32", 8, 8, 4),
    "f32-d8-g2-window-softcap": Config("float32", 8, 8, 4, sliding_window=21, soft_cap=5.0),
    "bf16-d16-g4-window": Config("bfloat16", 16, 4, 1, sliding_window=20),
    "f32-d32-g1-softcap": Config("float32", 32, 2, 2, soft_cap=5.0),
    "f32-d24-g2-window": Config("float32", 24, 4, 2, sliding_window=33),
}

# A request: (q_len, kv_len, shares_prefix_with_previous_request).
Batch = tuple[tuple[tuple[int, int, bool], ...], int]


@st.composite
def ragged_batches(draw: st.DrawFn) -> Batch:
    reqs: list[tuple[int, int, bool]] = []
    budget = NUM_TOKENS - draw(st.integers(0, 4))  # sometimes leave rows that belong to nobody
    for i in range(draw(st.integers(1, MAX_SEQS))):
        kind = draw(st.sampled_from(["decode", "chunk", "prefill"]))
        kv_len = draw(st.integers(1, MAX_KV))
        q_len = {"decode": 1, "prefill": kv_len}.get(kind) or draw(st.integers(1, kv_len))
        q_len = min(q_len, budget)
        if q_len == 0:
            break
        budget -= q_len
        reqs.append((q_len, kv_len, i > 0 and draw(st.booleans())))
    return tuple(reqs), draw(st.integers(0, 2**31 - 1))


DECODE_ONLY: Batch = (((1, 5, False), (1, MAX_KV, False), (1, 17, True), (1, 33, False)), 1)
PREFILL_ONLY: Batch = (((20, 20, False), (16, 16, True), (4, 4, True)), 2)
MIXED: Batch = (((1, 100, False), (12, 40, True), (3, 3, False), (1, 1, False), (9, 90, True)), 3)
# decodes verifying drafts (up to 4), next to plain ones
VERIFY: Batch = (((5, 40, False), (1, 9, False), (3, 17, False), (5, 100, True), (2, 2, False)), 5)


def on_ragged_batches(*examples: Batch) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The test on `examples`, then on a few batches hypothesis draws (few: shapes are fixed, so
    more draws only vary the data)."""
    def decorate(test: Callable[..., None]) -> Callable[..., None]:
        test = given(batch=ragged_batches())(test)
        for batch in reversed(examples):  # as a stack of @example, top one first
            test = example(batch=batch)(test)
        return settings(max_examples=4, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])(test)
    return decorate


@dataclasses.dataclass
class Inputs:
    args: tuple[jax.Array, ...]  # the kernel's positional arguments
    num_real_tokens: int
    needed_blocks: list[list[int]]  # per real request, the blocks holding its KV


def make_inputs(cfg: Config, batch: Batch) -> Inputs:
    reqs, seed = batch
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(cfg.dtype)
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    tables = rng.integers(0, NUM_BLOCKS, (MAX_SEQS, PAGES_PER_SEQ)).astype(np.int32)  # stale
    seq_lens = np.zeros(MAX_SEQS, np.int32)
    q_lens = np.zeros(MAX_SEQS, np.int32)
    needed: list[list[int]] = []
    for r, (q_len, kv_len, share) in enumerate(reqs):
        num_pages = -(-kv_len // BLOCK_SIZE)
        shared = needed[-1][: int(rng.integers(1, num_pages + 1))] if share else []
        blocks = shared + [int(free.pop()) for _ in range(num_pages - len(shared))]
        tables[r, :num_pages] = blocks
        needed.append(blocks)
        seq_lens[r], q_lens[r] = kv_len, q_len
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_shape = (NUM_LAYERS, cfg.num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, cfg.head_dim)
    args = (jnp.asarray(rng.standard_normal((NUM_TOKENS, cfg.num_q_heads, cfg.head_dim)), dt),
            jnp.asarray(rng.standard_normal(kv_shape), dt),
            jnp.asarray(rng.standard_normal(kv_shape), dt),
            jnp.int32(LAYER), jnp.asarray(seq_lens), jnp.asarray(tables), jnp.asarray(qsl))
    return Inputs(args, int(qsl[-1]), needed)


@functools.cache
def compiled(kernel: str, name: str) -> Callable[..., jax.Array]:
    cfg = {**CONFIGS, **CPU_CONFIGS}[name]
    kw = dict(sm_scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
              soft_cap=cfg.soft_cap)
    if kernel == "reference":
        return jax.jit(functools.partial(ragged_paged_attention_xla, **kw))
    tiles = dict({"tpu": cfg.tpu_tiles, "gpu": cfg.gpu_tiles}.get(kernel, ()))
    return jax.jit(functools.partial(KERNELS[kernel], **kw, **tiles))


def max_error(out: jax.Array, ref: jax.Array, n: int, dtype: str) -> float:
    """Largest |out - ref| beyond the tolerance's relative part, over the first n rows."""
    _, rtol = TOLERANCE[dtype]
    out, ref = np.asarray(out[:n], np.float32), np.asarray(ref[:n], np.float32)
    return float(np.max(np.abs(out - ref) - rtol * np.abs(ref), initial=0.0))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kernel", list(KERNELS))
@on_ragged_batches(DECODE_ONLY, PREFILL_ONLY, MIXED)
def test_kernel_matches_reference_on_ragged_batches(kernel: str, name: str, batch: Batch) -> None:
    check_against_reference(kernel, name, CONFIGS[name], batch)


@pytest.mark.parametrize("name", list(CPU_CONFIGS))
@on_ragged_batches(DECODE_ONLY, MIXED, VERIFY)
def test_cpu_kernel_matches_reference_at_other_head_dims(name: str, batch: Batch) -> None:
    check_against_reference("cpu", name, CPU_CONFIGS[name], batch)


def check_against_reference(kernel: str, name: str, cfg: Config, batch: Batch) -> None:
    inputs = make_inputs(cfg, batch)
    out = compiled(kernel, name)(*inputs.args)
    ref = compiled("reference", name)(*inputs.args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert bool(jnp.all(jnp.isfinite(out))), "padding rows or requests produced NaN/inf"
    err = max_error(out, ref, inputs.num_real_tokens, cfg.dtype)
    assert err <= TOLERANCE[cfg.dtype][0], f"{kernel} {name}: error {err} over tolerance"


@pytest.mark.parametrize("name", list(CONFIGS))
@on_ragged_batches(DECODE_ONLY, MIXED, VERIFY)
def test_fused_write_stores_what_the_scatter_does_and_attends_after_it(name: str,
                                                                       batch: Batch) -> None:
    """write_and_attend = the xla backend's write_kv, then its attention. Requests own the
    blocks their new rows land in (a prefix shared with another request is full: the scheduler
    never writes into a shared block)."""
    cfg = CONFIGS[name]
    reqs, seed = batch
    inputs = make_inputs(cfg, (tuple((q, kv, False) for q, kv, _ in reqs), seed))
    q, k_cache, v_cache, layer, seq_lens, tables, qsl = inputs.args
    rng = np.random.default_rng(seed + 1)
    k, v = (jnp.asarray(rng.standard_normal((NUM_TOKENS, cfg.num_kv_heads, cfg.head_dim)),
                        cfg.dtype) for _ in "kv")
    n = inputs.num_real_tokens
    slots = []
    for r, (q_len, kv_len, _) in enumerate(reqs):
        for pos in range(kv_len - q_len, kv_len):
            slots.append(int(tables[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    want_k, want_v = write_kv(k_cache, v_cache, layer, k[:n], v[:n], jnp.asarray(slots, jnp.int32))
    want = compiled("reference", name)(q, want_k, want_v, layer, seq_lens, tables, qsl)
    out, got_k, got_v = fused(name)(q, k, v, k_cache, v_cache, layer, seq_lens, tables, qsl)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    err = max_error(out, want, n, cfg.dtype)
    assert err <= TOLERANCE[cfg.dtype][0], f"{name}: error {err} over tolerance"


@functools.cache
def fused(name: str) -> Callable[..., tuple[jax.Array, ...]]:
    cfg = CONFIGS[name]
    return jax.jit(functools.partial(
        write_and_attend, sm_scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
        soft_cap=cfg.soft_cap, interpret=True, **dict(cfg.tpu_tiles)))


@pytest.mark.parametrize(("kernel", "name"), [(k, "f32-d64-g1") for k in KERNELS]
                         + [("cpu", "f32-d8-g2")])
def test_kernel_reads_only_the_visible_kv_of_its_layer(kernel: str, name: str) -> None:
    """NaN everywhere a request must not look (the other layer, blocks no request uses, the null
    block, stale table entries, slots past seq_len, padding query rows) changes nothing."""
    cfg = {**CONFIGS, **CPU_CONFIGS}[name]
    batch: Batch = (((1, 37, False), (7, 21, False), (10, 10, False), (1, 128, False)), 4)
    if kernel == "cpu":  # decodes only: its tiles are the xla backend's, whose masked
        # probabilities (zeros) still multiply whatever V holds there
        batch = (((1, 37, False), (5, 21, False), (1, 10, False), (3, 128, False)), 4)
    inputs = make_inputs(cfg, batch)
    clean = compiled(kernel, name)(*inputs.args)
    q, k, v, layer, seq_lens, tables, qsl = inputs.args
    visible = np.zeros((NUM_BLOCKS, BLOCK_SIZE), bool)
    for blocks, kv_len in zip(inputs.needed_blocks, np.asarray(seq_lens), strict=False):
        for i, block in enumerate(blocks):
            visible[block, : min(BLOCK_SIZE, kv_len - i * BLOCK_SIZE)] = True
    poison = np.ones((NUM_LAYERS, 1, NUM_BLOCKS, BLOCK_SIZE, 1), bool)
    poison[LAYER, 0, :, :, 0] = ~visible

    def poisoned(x: jax.Array) -> jax.Array:
        return jnp.where(jnp.asarray(poison), jnp.nan, x)

    stale = np.asarray(tables).copy()
    for r, blocks in enumerate(inputs.needed_blocks):
        stale[r, len(blocks):] = 0
    stale[len(inputs.needed_blocks):] = 0
    n = inputs.num_real_tokens
    dirty = compiled(kernel, name)(q.at[n:].set(jnp.nan), poisoned(k), poisoned(v), layer,
                                   seq_lens, jnp.asarray(stale), qsl)
    np.testing.assert_array_equal(np.asarray(dirty[:n]), np.asarray(clean[:n]))
