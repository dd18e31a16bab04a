"""Tile sizes for the ragged paged-attention kernels: defaults, and start-up checks against the
hardware's limits. Every check raises ValueError naming the parameter and its value."""

from __future__ import annotations

import numpy as np

TPU_SMEM_BYTES = 1 << 20  # scalar memory holds the block table, lengths and query_start_loc
TPU_SMEM_RESERVED_BYTES = 16 << 10  # left for Mosaic's own scalars
TPU_MAX_VMEM_BYTES = 60 << 20  # of the smallest VMEM (64 MiB a core: v5p, TPU7x)
TPU_LANES = 128
TPU_SUBLANES = 8
GPU_MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16
GPU_MAX_HEAD_DIM = 256


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tpu_sublanes(dtype: np.dtype | str) -> int:
    """Rows per native TPU tile of this dtype: 8 for 32-bit, 16 for bf16, 32 for 8-bit."""
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is None or int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    _check_positive(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    return num_q_heads // num_kv_heads


def check_attention_args(q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                         v_shape: tuple[int, ...], sliding_window: int | None,
                         soft_cap: float | None) -> None:
    """The arguments every kernel takes: q [T, Hq, D], caches [L, Hkv, NB, BS, D]."""
    _, Hq, D = q_shape
    Hkv, Dk = k_shape[1], k_shape[-1]
    if Dk != D or v_shape != k_shape:
        raise ValueError(f"k_cache/v_cache shapes {k_shape}/{v_shape} do not match "
                         f"q head_dim {D}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    if Hq % Hkv:
        raise ValueError(f"num_q_heads={Hq} must be a multiple of num_kv_heads={Hkv}")


def default_tpu_tiles(*, block_size: int) -> tuple[int, int]:
    """(num_kv_pages_per_block, sub_rows): KV blocks of ~512 tokens (each one copy-and-compute
    step of the kernel's work list, so few steps per decode) and query sub-tiles of 512 rows
    for prefill chunks (a [512, 512] f32 score tile)."""
    return max(1, min(16, 512 // block_size)), 512


def tpu_smem_bytes(max_num_seqs: int, pages_per_seq: int) -> int:
    """Scalar-prefetch bytes: block table + seq_lens + first tiles + query_start_loc + layer."""
    return 4 * (max_num_seqs * pages_per_seq + 3 * max_num_seqs + 2)


def tpu_vmem_bytes(*, group: int, head_dim: int, block_size: int, kv_itemsize: int,
                   q_itemsize: int, num_kv_pages_per_block: int, sub_rows: int,
                   num_tokens: int, max_num_seqs: int) -> int:
    """VMEM a kernel instance needs: one head's query rows, output rows and new-row tiles (one
    buffer each), their f32 accumulator and softmax stats, the double-buffered K and V blocks
    and a sub-tile's f32 score temporaries."""
    lanes = -(-head_dim // TPU_LANES) * TPU_LANES
    tile_rows = tpu_sublanes(np.dtype("float32" if kv_itemsize >= 4 else "bfloat16"))
    rows = num_tokens * group + sub_rows
    units = num_tokens // tile_rows + 2 * max_num_seqs
    kv_tokens = num_kv_pages_per_block * block_size
    io = 2 * rows * lanes * q_itemsize + 2 * units * tile_rows * lanes * kv_itemsize
    state = rows * lanes * 4 + 2 * rows * TPU_LANES * 4
    kv_bufs = 2 * 2 * kv_tokens * lanes * kv_itemsize
    scores = 3 * sub_rows * kv_tokens * 4
    return io + state + kv_bufs + scores


def validate_tpu_tiling(*, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                        max_num_seqs: int, pages_per_seq: int, num_kv_pages_per_block: int,
                        sub_rows: int, num_tokens: int, q_dtype: np.dtype | str = "float32",
                        kv_dtype: np.dtype | str = "float32",
                        vmem_limit_bytes: int | None = None) -> None:
    """Checks a TPU (Mosaic) kernel configuration; raises ValueError naming the bad parameter."""
    group = _check_heads(num_q_heads, num_kv_heads)
    _check_positive(head_dim=head_dim, block_size=block_size, max_num_seqs=max_num_seqs,
                    pages_per_seq=pages_per_seq, num_kv_pages_per_block=num_kv_pages_per_block,
                    sub_rows=sub_rows, num_tokens=num_tokens)
    kv_sub = tpu_sublanes(kv_dtype)
    if block_size % kv_sub:
        raise ValueError(f"block_size={block_size} must be a multiple of {kv_sub} on TPU for "
                         f"{np.dtype(kv_dtype).name} KV pages, so each page fills whole VMEM tiles")
    q_sub = tpu_sublanes(q_dtype)
    if sub_rows % q_sub:
        raise ValueError(f"sub_rows={sub_rows} must be a multiple of {q_sub} "
                         f"({np.dtype(q_dtype).name} query rows fill whole tiles)")
    smem = tpu_smem_bytes(max_num_seqs, pages_per_seq)
    if smem > TPU_SMEM_BYTES - TPU_SMEM_RESERVED_BYTES:
        raise ValueError(
            f"block table of max_num_seqs={max_num_seqs} x pages_per_seq={pages_per_seq} needs "
            f"{smem} bytes of TPU scalar memory (limit ~{TPU_SMEM_BYTES - TPU_SMEM_RESERVED_BYTES}"
            "); lower max_num_seqs or max_model_len, or raise block_size")
    limit = TPU_MAX_VMEM_BYTES if vmem_limit_bytes is None else vmem_limit_bytes
    vmem = tpu_vmem_bytes(group=group, head_dim=head_dim, block_size=block_size,
                          kv_itemsize=np.dtype(kv_dtype).itemsize,
                          q_itemsize=np.dtype(q_dtype).itemsize,
                          num_kv_pages_per_block=num_kv_pages_per_block, sub_rows=sub_rows,
                          num_tokens=num_tokens, max_num_seqs=max_num_seqs)
    if vmem > limit:
        raise ValueError(f"num_tokens={num_tokens} (query rows of {group} heads each), "
                         f"num_kv_pages_per_block={num_kv_pages_per_block} and "
                         f"sub_rows={sub_rows} need ~{vmem} bytes of VMEM, over {limit}; lower "
                         "max_num_batched_tokens")


def default_gpu_tiles(*, group: int, block_size: int, num_tokens: int,
                      num_reqs: int | None = None) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) for the Triton kernel: 64 KV tokens per
    step, and query tiles whose rows (tokens x padded group) are a power of two >= 16, fewer
    when the whole batch is smaller. A step with room for more tokens than requests
    (`num_reqs`, a prefill's bucket) takes 256 rows: a program reads a chunk's visible KV once
    per tile, so larger tiles read a long prefix fewer times. A decode's bucket takes 64: a
    tile computes all its rows against each of its requests' KV blocks, and a decode has one
    token's (on H200 256-row tiles made a 128-decode step compute-bound on masked rows)."""
    pages = max(1, 64 // block_size)
    min_queries = max(1, GPU_MIN_DOT_DIM // next_pow2(group))
    rows = 256 if num_reqs is not None and num_tokens > num_reqs else 64
    queries = max(min_queries, min(next_pow2(num_tokens), rows // next_pow2(group)))
    return pages, queries


def validate_gpu_tiling(*, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                        num_kv_pages_per_block: int, num_queries_per_block: int) -> None:
    """Checks a GPU (Triton) kernel configuration; raises ValueError naming the bad parameter."""
    group = _check_heads(num_q_heads, num_kv_heads)
    _check_positive(head_dim=head_dim, block_size=block_size,
                    num_kv_pages_per_block=num_kv_pages_per_block,
                    num_queries_per_block=num_queries_per_block)
    if not _is_pow2(head_dim) or not GPU_MIN_DOT_DIM <= head_dim <= GPU_MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be a power of two in "
                         f"[{GPU_MIN_DOT_DIM}, {GPU_MAX_HEAD_DIM}] for the Triton kernel")
    for name, value in (("block_size", block_size),
                        ("num_kv_pages_per_block", num_kv_pages_per_block),
                        ("num_queries_per_block", num_queries_per_block)):
        if not _is_pow2(value):
            raise ValueError(f"{name}={value} must be a power of two for the Triton kernel")
    kv_tokens = num_kv_pages_per_block * block_size
    if kv_tokens < GPU_MIN_DOT_DIM:
        raise ValueError(
            f"num_kv_pages_per_block={num_kv_pages_per_block} x block_size={block_size} = "
            f"{kv_tokens} KV tokens per step must be >= {GPU_MIN_DOT_DIM} (Triton dot)")
    rows = num_queries_per_block * next_pow2(group)
    if rows < GPU_MIN_DOT_DIM:
        raise ValueError(
            f"num_queries_per_block={num_queries_per_block} x {next_pow2(group)} q heads per KV "
            f"head (padded) = {rows} rows must be >= {GPU_MIN_DOT_DIM} (Triton dot)")
