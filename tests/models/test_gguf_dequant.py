"""The whole-tensor dequantisers give gguf.quants' float32 values bit for bit, on every nibble and
int8 value, negative and subnormal scales included; other formats are gguf.quants' own."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference, quantize

from jaxserve.models.gguf_dequant import dequantize

BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


def random_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """u8[rows, blocks_per_row * block bytes]: random quants under finite float16 scales (and
    minimums) spanning subnormal to large, both signs."""
    rng = np.random.default_rng(seed)
    n = rows * blocks_per_row
    blocks = rng.integers(0, 256, (n, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = 2 if qtype is Q.Q4_1 else 1
    scales = (rng.choice([-1, 1], (n, halves)) * 10.0 ** rng.uniform(-7, 4, (n, halves)))
    blocks[:, :2 * halves] = scales.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))
def test_block_formats_match_gguf_quants_bit_for_bit(qtype: Q) -> None:
    data = random_blocks(qtype, rows=12, blocks_per_row=5, seed=int(qtype))
    got = dequantize(data, qtype)
    want = reference(data, qtype).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_quantized_weights_round_trip_as_the_library_reads_them(qtype: Q) -> None:
    weights = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = quantize(weights, qtype)
    np.testing.assert_array_equal(dequantize(data, qtype), reference(data, qtype))
    assert np.abs(dequantize(data, qtype).reshape(8, 64) - weights).max() < 0.5


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q5_0, Q.Q5_1])
def test_other_formats_are_the_librarys_and_never_a_view(qtype: Q) -> None:
    weights = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    data = quantize(weights, qtype)
    got = dequantize(data, qtype)
    np.testing.assert_array_equal(got, reference(data, qtype).astype(np.float32))
    assert got.dtype == np.float32 and not np.may_share_memory(got, data)
