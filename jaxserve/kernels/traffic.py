"""What a kernel call moves to and from device memory, modelled from its tiling and the step's
ragged batch: the part of a step's cost that XLA's own analysis cannot see inside a custom call.
Each kernel module has a `hbm_traffic` beside it that walks the same work list as the kernel;
tests check it against the DMAs the kernel issues in TPU interpret mode."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class RaggedBatch:
    """One step's requests as the kernels see them: query rows and KV length after the step."""
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError(f"{len(self.q_lens)} q_lens for {len(self.kv_lens)} kv_lens")
        if any(q <= 0 or kv < q for q, kv in zip(self.q_lens, self.kv_lens)):
            raise ValueError("every request needs q_len >= 1 and kv_len >= q_len")

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def query_start_loc(self) -> list[int]:
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out


@dataclass
class KernelTraffic:
    """What one call moves through the operands it reads and writes by DMA itself (the caches,
    left in device memory), and the flops it runs. Its other operands and results pass once
    through the grid's pipeline: the caller counts those from their shapes."""
    manual_operands: tuple[int, ...]  # indices of the operands counted here
    kv_read: float = 0.0
    kv_write: float = 0.0
    weights: float = 0.0  # of the model's params (a grouped matmul's experts)
    flops: float = 0.0


def visible_range(q_start: int, q_len: int, kv_len: int, row_lo: int, row_hi: int,
                  sliding_window: int | None) -> tuple[int, int]:
    """[lo, hi): KV positions rows [row_lo, row_hi) of a request may attend to (causal, and
    within the window)."""
    first_pos = kv_len - q_len
    hi = first_pos + row_hi
    lo = 0 if sliding_window is None else max(first_pos + row_lo - sliding_window + 1, 0)
    return (lo, hi) if row_hi > row_lo and hi > lo else (lo, lo)


def tiled_name(kernel: str, **params: int) -> str:
    """The kernel's name with its static tiling, which the name carries into the HLO for the
    cost model to read: `kernel_g4_q16_p4_w0`."""
    return kernel + "".join(f"_{key}{value}" for key, value in params.items())


def name_params(name: str, prefix: str) -> dict[str, int]:
    """The inverse of `tiled_name`."""
    if not name.startswith(prefix):
        raise ValueError(f"{name!r} is not a {prefix} kernel")
    return {k: int(v) for k, v in re.findall(r"_([a-z])(\d+)", name[len(prefix):])}


def tile_walk_traffic(batch: RaggedBatch, manual_operands: tuple[int, ...], *,
                      num_kv_heads: int, group: int, num_tokens_padded: int,
                      queries_per_block: int, pages_per_block: int, page_size: int,
                      head_dim: int, kv_itemsize: int, sliding_window: int | None,
                      ) -> KernelTraffic:
    """A kernel that walks ragged_schedule's work list per (kv head, query tile): for each
    request with rows in the tile, the KV blocks those rows can see. It reads each needed
    page, K and V, and multiplies every row of the tile (masked ones too) by every block."""
    qsl = batch.query_start_loc
    page_bytes = 2 * page_size * head_dim * kv_itemsize  # K and V
    block_tokens = pages_per_block * page_size
    rows = queries_per_block * group
    out = KernelTraffic(manual_operands)
    for q_lo in range(0, num_tokens_padded, queries_per_block):
        q_hi = q_lo + queries_per_block
        for r, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
            start = qsl[r]
            if start >= q_hi or start + q_len <= q_lo:
                continue
            lo, hi = visible_range(start, q_len, kv_len, max(q_lo, start) - start,
                                   min(q_hi, start + q_len) - start, sliding_window)
            if hi > lo:
                out.kv_read += page_bytes * (-(-hi // page_size) - lo // page_size)
                blocks = -(-hi // block_tokens) - lo // block_tokens
                out.flops += 2 * 2 * rows * block_tokens * head_dim * blocks  # q.k and p.v
    out.kv_read *= num_kv_heads
    out.flops *= num_kv_heads
    return out
