"""GGUF tensors to float32. The 32-element block formats a small checkpoint is usually shipped
in (Q4_0, Q4_1, Q8_0) are dequantised here a whole tensor at a time; the other formats go to
`gguf.quants`, the reference these are checked against bit for bit.

`gguf.quants` works through a tensor 16 rows at a time, each group a handful of small numpy
calls and a concatenation: most of its time is Python holding the GIL, which the loader's
threads and the engine's start-up work beside it then wait on. One pass of a few in-place numpy
calls over the tensor takes 4-5x less CPU (scripts/bench_gguf_dequant.py); the weights are in
before the engine needs them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as library_dequantize

_BLOCK = 32  # elements a Q4_0 / Q4_1 / Q8_0 block holds


def _f16_column(blocks: np.ndarray, offset: int) -> np.ndarray:
    """f32[n_blocks, 1]: the float16 stored at byte `offset` of each block."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """f32[n_blocks, 32] from u8[n_blocks, 16]: the low nibbles are elements 0-15 of a block,
    the high nibbles elements 16-31."""
    out = np.empty((qs.shape[0], _BLOCK), np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :_BLOCK // 2], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, _BLOCK // 2:], casting="unsafe")
    return out


def _q4_0(blocks: np.ndarray) -> np.ndarray:  # block: f16 scale, 16 bytes of nibbles
    out = _nibbles(blocks[:, 2:])
    out -= 8
    out *= _f16_column(blocks, 0)
    return out


def _q4_1(blocks: np.ndarray) -> np.ndarray:  # block: f16 scale, f16 minimum, 16 bytes
    out = _nibbles(blocks[:, 4:])
    out *= _f16_column(blocks, 0)
    out += _f16_column(blocks, 2)
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:  # block: f16 scale, 32 int8
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _f16_column(blocks, 0)
    return out


_BLOCK_FORMATS: dict[GGMLQuantizationType, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q8_0: (34, _q8_0),
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A tensor's raw data (float elements, or uint8 rows of blocks) as float32 elements, shaped
    as `gguf.quants.dequantize` shapes them; never a view of `data` (a mapped file)."""
    if qtype not in _BLOCK_FORMATS:
        out = library_dequantize(data, qtype)
        if np.may_share_memory(out, data):  # F32 comes back as a view of the mapped file
            out = out.copy()
        return out.astype(np.float32, copy=False)
    block_bytes, dequantize_blocks = _BLOCK_FORMATS[qtype]
    blocks = np.asarray(data, np.uint8).reshape(-1, block_bytes)
    return dequantize_blocks(blocks).reshape(*data.shape[:-1], -1)
