"""Times the ragged paged-attention kernels against the pure-JAX reference on the present device.

CPU: the `cpu` backend (the native kernel) and both Pallas
kernels in interpret mode (small shapes). TPU: the Mosaic kernel. GPU: the Triton
kernel. On a TPU or GPU it also reports achieved memory bandwidth, (KV pages + q bytes read) / time,
as a fraction of the device's peak. Writes a markdown table to results/bench_attention.md.

    python scripts/bench_attention.py [--iters 20] [--size auto|small|large] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels import (
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
)
from jaxserve.kernels.cpu import native as cpu_native, paged_attention as cpu_paged_attention

# (atol, rtol) against the reference, as tests/kernels/test_ragged_paged_attention.py
TOLERANCE = {"float32": (1e-5, 0.0), "bfloat16": (1.6e-2, 1e-2)}
# Peak HBM bandwidth in bytes/s, matched by substring of jax's device_kind (first match wins).
PEAK_BANDWIDTH = [
    ("TPU v5 lite", 819e9), ("TPU v5e", 819e9), ("TPU v6 lite", 1640e9), ("TPU v6e", 1640e9),
    ("TPU v5p", 2765e9), ("TPU v5", 2765e9), ("TPU v4", 1228e9), ("TPU7x", 7380e9),
    ("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12), ("L40S", 864e9),
    ("L4", 300e9), ("A10G", 600e9), ("RTX 4090", 1008e9),
]


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 128
    block_size: int = 16


def shapes(size: str) -> list[Shape]:
    if size == "small":  # CPU, interpret mode
        return [
            Shape("decode 32 x 512", (1,) * 32, (512,) * 32, 8, 2),
            Shape("mixed 14 decodes + 2 chunks", (1,) * 14 + (64, 64), (512,) * 14 + (256, 128),
                  8, 2),
            Shape("prefill 1 x 256", (256,), (256,), 8, 2),
        ]
    return [
        Shape("decode 128 x 2048", (1,) * 128, (2048,) * 128, 32, 8),
        Shape("decode 256 x 1024 (GQA 8)", (1,) * 256, (1024,) * 256, 64, 8),
        Shape("mixed 120 decodes + 2 chunks", (1,) * 120 + (512, 512),
              (2048,) * 120 + (1024, 4096), 32, 8),
        Shape("prefill 1 x 4096", (4096,), (4096,), 32, 8),
    ]


def make_inputs(shape: Shape, dtype: jnp.dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    R = len(shape.q_lens)
    pages = [-(-kv // shape.block_size) for kv in shape.kv_lens]
    P, NB = max(pages), sum(pages) + 1
    tables = np.zeros((R, P), np.int32)
    ids = rng.permutation(np.arange(1, NB)).astype(np.int32)
    start = 0
    for r, n in enumerate(pages):
        tables[r, :n] = ids[start:start + n]
        start += n
    T = sum(shape.q_lens)
    kv_shape = (1, shape.num_kv_heads, NB, shape.block_size, shape.head_dim)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(key_q, (T, shape.num_q_heads, shape.head_dim), dtype),
            jax.random.normal(key_k, kv_shape, dtype), jax.random.normal(key_v, kv_shape, dtype),
            jnp.int32(0), jnp.asarray(shape.kv_lens, jnp.int32), jnp.asarray(tables),
            jnp.asarray(np.concatenate([[0], np.cumsum(shape.q_lens)]), jnp.int32))


def excess_error(out: jax.Array, ref: jax.Array, dtype: jnp.dtype) -> float:
    """Largest |out - ref| beyond the tolerance (negative or 0: within it), over real rows."""
    atol, rtol = TOLERANCE[dtype.name]
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(out - ref) - rtol * np.abs(ref) - atol))


def bytes_read(shape: Shape, dtype: jnp.dtype) -> int:
    """KV pages each request touches (K and V) plus the queries."""
    item = jnp.dtype(dtype).itemsize
    kv_tokens = sum(-(-kv // shape.block_size) * shape.block_size for kv in shape.kv_lens)
    kv = 2 * kv_tokens * shape.num_kv_heads * shape.head_dim * item
    return kv + sum(shape.q_lens) * shape.num_q_heads * shape.head_dim * item


def time_call(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...],
              iters: int) -> tuple[jax.Array, float, float]:
    """(output, compile + first call seconds, ms per call). The timed calls run in 5 rounds of
    back-to-back dispatches with one wait at each round's end, so a fast device kernel is not
    timed as its launch and sync latency; the median round counts."""
    start = time.perf_counter()
    out = fn(*args).block_until_ready()
    first = time.perf_counter() - start
    per_round = max(1, iters // 5)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(per_round):
            last = fn(*args)
        last.block_until_ready()
        times.append((time.perf_counter() - start) / per_round)
    return out, first, 1e3 * statistics.median(times)


def backends(platform: str) -> dict[str, Callable[..., jax.Array]]:
    found: dict[str, Callable[..., jax.Array]] = {
        "reference (xla)": ragged_paged_attention_xla}
    if platform == "tpu":
        found["pallas tpu"] = ragged_paged_attention_tpu
    elif platform == "gpu":
        found["pallas gpu (triton)"] = ragged_paged_attention_gpu
    else:
        if cpu_native.available():
            found["cpu (native)"] = cpu_paged_attention.ragged_paged_attention
        found["pallas tpu (interpret)"] = functools.partial(ragged_paged_attention_tpu,
                                                             interpret=True)
        found["pallas gpu (interpret)"] = functools.partial(ragged_paged_attention_gpu,
                                                             interpret=True)
    return found


def peak_bandwidth(device_kind: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH if key in device_kind), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--size", choices=["auto", "small", "large"], default="auto")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 elsewhere")
    parser.add_argument("--out", type=Path, default=Path("results/bench_attention.md"))
    opts = parser.parse_args()
    device = jax.devices()[0]
    platform, kind = device.platform, device.device_kind
    size = opts.size if opts.size != "auto" else ("small" if platform == "cpu" else "large")
    dtype = jnp.dtype(opts.dtype or ("float32" if platform == "cpu" else "bfloat16"))
    peak = peak_bandwidth(kind) if platform != "cpu" else None

    rows, failures = [], 0
    for shape in shapes(size):
        args = make_inputs(shape, dtype)
        nbytes = bytes_read(shape, dtype)
        real_rows = sum(shape.q_lens)
        ref_out, ref_ms = None, None
        for name, kernel in backends(platform).items():
            fn = jax.jit(functools.partial(kernel, sm_scale=shape.head_dim ** -0.5))
            try:
                out, first, ms = time_call(fn, args, opts.iters)
            except Exception as e:  # noqa: BLE001 - one broken backend must not hide the others
                failures += 1
                rows.append(f"| {shape.name} | {name} | error: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120] if str(e) else ''} | | | | | |")
                print(rows[-1], flush=True)
                continue
            if ref_out is None:
                ref_out, ref_ms = out, ms
            excess = excess_error(out[:real_rows], ref_out[:real_rows], dtype)
            failures += excess > 0
            gbs = nbytes / (ms * 1e-3) / 1e9
            frac = f"{100 * gbs * 1e9 / peak:.1f}%" if peak else "n/a"
            match = ("(is the reference)" if out is ref_out else "yes" if excess <= 0
                     else f"NO (over tolerance by {excess:.3g})")
            rows.append(f"| {shape.name} | {name} | {ms:.3f} | {ref_ms / ms:.2f}x | {first:.1f} | "
                        f"{gbs:.1f} | {frac} | {match} |")
            print(rows[-1], flush=True)

    header = [
        f"# Ragged paged attention: kernel vs reference on {platform} ({kind})", "",
        f"dtype {dtype.name}, {opts.iters} timed calls each in 5 back-to-back rounds (median "
        f"round), jax {jax.__version__}. "
        "GB/s = (KV pages touched, K and V, + q bytes) / time. "
        f"Matches: within (atol, rtol) = {TOLERANCE[dtype.name]} of the reference"
        + (f"; peak {peak / 1e9:.0f} GB/s." if peak else "; no peak on CPU."), "",
        "| shape | backend | ms/call | speed-up vs reference | compile + 1st call (s) | GB/s "
        "| % of peak | matches reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text("\n".join(header + rows) + "\n")
    print(f"wrote {opts.out}; {failures} kernel(s) failed or mismatched")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
