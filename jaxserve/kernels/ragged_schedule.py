"""Scalar bookkeeping shared by the ragged paged-attention kernels (TPU and GPU).

A kernel instance owns one tile of query rows [q_lo, q_hi) of the flattened ragged batch. It walks a
work list of (request, kv block) pairs: the requests whose rows overlap the tile, each with the KV
blocks those rows can see (causal, optionally windowed). Everything here runs inside a kernel on
int32 scalars read from refs (SMEM on TPU, global memory on GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def _first_true(pred: Any, n: int) -> jax.Array:
    """Smallest i in [0, n) with pred(i), or n; pred must be monotone (False...True)."""

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = jnp.minimum((lo + hi) // 2, n - 1)  # stays a valid index once lo == hi == n
        go_left = pred(mid)
        active = lo < hi
        new_lo = jnp.where(active & ~go_left, mid + 1, lo)
        new_hi = jnp.where(active & go_left, mid, hi)
        return new_lo, new_hi

    lo, _ = jax.lax.fori_loop(0, n.bit_length() + 1, step, (jnp.int32(0), jnp.int32(n)))
    return lo


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    seq_lens_ref: Any  # i32[R]
    query_start_loc_ref: Any  # i32[R + 1]
    q_lo: jax.Array  # i32[]  first query row of the tile
    q_hi: jax.Array  # i32[]  one past the last query row of the tile
    num_reqs: int
    page_size: int
    pages_per_block: int
    pages_per_seq: int
    sliding_window: int | None

    @property
    def block_tokens(self) -> int:
        return self.page_size * self.pages_per_block

    def _clamp(self, r: jax.Array) -> jax.Array:
        return jnp.clip(r, 0, self.num_reqs - 1)

    def request_bounds(self) -> tuple[jax.Array, jax.Array]:
        """[r_first, r_end): the requests that may own rows of this tile."""
        qsl = self.query_start_loc_ref
        r_first = _first_true(lambda r: qsl[r + 1] > self.q_lo, self.num_reqs)
        r_end = _first_true(lambda r: qsl[r] >= self.q_hi, self.num_reqs)
        return r_first, jnp.maximum(r_end, r_first)

    def request_rows(self, r: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q_start, q_len, kv_len) of request r (r is clamped into range)."""
        r = self._clamp(r)
        q_start = self.query_start_loc_ref[r]
        q_len = self.query_start_loc_ref[r + 1] - q_start
        return q_start, q_len, self.seq_lens_ref[r]

    def token_range(self, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[lo, hi): the KV positions that request r's rows inside this tile may attend to."""
        q_start, q_len, kv_len = self.request_rows(r)
        row_lo = jnp.maximum(self.q_lo, q_start) - q_start
        row_hi = jnp.minimum(self.q_hi, q_start + q_len) - q_start
        first_pos = kv_len - q_len  # position of the request's row 0
        hi = jnp.minimum(first_pos + row_hi, self.pages_per_seq * self.page_size)
        lo = jnp.int32(0)
        if self.sliding_window is not None:
            lo = jnp.maximum(first_pos + row_lo - self.sliding_window + 1, 0)
        empty = (row_hi <= row_lo) | (hi <= lo)
        return lo, jnp.where(empty, lo, hi)

    def page_range(self, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        lo, hi = self.token_range(r)
        return lo // self.page_size, (hi + self.page_size - 1) // self.page_size

    def block_range(self, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        lo, hi = self.token_range(r)
        bt = self.block_tokens
        return lo // bt, jnp.where(hi > lo, (hi + bt - 1) // bt, lo // bt)

    def first_busy(self, r: jax.Array, r_end: jax.Array) -> jax.Array:
        """The first request >= r (and < r_end) with KV work in this tile, or r_end."""

        def idle(r: jax.Array) -> jax.Array:
            lo, hi = self.block_range(r)
            return (r < r_end) & (hi <= lo)

        return jax.lax.while_loop(idle, lambda r: r + 1, r)

    def next(self, r: jax.Array, b: jax.Array, r_end: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The work item after (r, b); the request is r_end once the list is exhausted."""
        _, b_hi = self.block_range(r)
        r_next = self.first_busy(r + 1, r_end)
        b_next, _ = self.block_range(r_next)
        stay = b + 1 < b_hi
        return jnp.where(stay, r, r_next), jnp.where(stay, b + 1, b_next)

    def mask(self, r: jax.Array, b: jax.Array, shape: tuple[int, int], group: int) -> jax.Array:
        """bool[rows, cols]: row i (token q_lo + i // group) may see KV position b * block + col."""
        q_start, q_len, kv_len = self.request_rows(r)
        row = jax.lax.broadcasted_iota(jnp.int32, shape, 0) // group + (self.q_lo - q_start)
        kv_pos = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + b * self.block_tokens
        q_pos = kv_len - q_len + row
        mask = (row >= 0) & (row < q_len) & (kv_pos <= q_pos)
        if self.sliding_window is not None:
            mask &= kv_pos > q_pos - self.sliding_window
        return mask
