"""The plain oracle of ragged paged attention: numpy, one query row and head at a time, exactly
the contract in xla/attention.py's docstring with nothing optimised. Slow; for tests only."""

from __future__ import annotations

import numpy as np


def ragged_paged_attention(
    q: np.ndarray,  # [T, Hq, D]
    k_cache: np.ndarray,  # [L, Hkv, NB, BS, D]
    v_cache: np.ndarray,  # [L, Hkv, NB, BS, D]
    layer: int,
    seq_lens: np.ndarray,  # i32[R]
    block_tables: np.ndarray,  # i32[R, P]
    query_start_loc: np.ndarray,  # i32[R + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> np.ndarray:  # [T, Hq, D]; rows of no request are 0
    q = np.asarray(q, np.float64)
    num_q_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for r, kv_len in enumerate(np.asarray(seq_lens).tolist()):
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        k = k_cache[layer][:, block_tables[r]].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        v = v_cache[layer][:, block_tables[r]].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        for i in range(end - start):
            pos = kv_len - (end - start) + i  # the row's position: causality is kv_pos <= pos
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_q_heads):
                s = k[h // group, lo:pos + 1] @ q[start + i, h] * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[start + i, h] = (p / p.sum()) @ v[h // group, lo:pos + 1]
    return out.astype(np.asarray(k_cache).dtype)
