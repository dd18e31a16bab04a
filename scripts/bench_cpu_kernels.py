"""The native CPU kernels against XLA:CPU's own, side by side in one run: (a) the dense layers'
matmul (jaxserve/kernels/cpu_matmul.cc over its packed weights) against `jnp.dot` compiled by
XLA:CPU as it comes (its YNNPACK dot fusion), with its own dot (YNNPACK off) and with oneDNN;
(b) the `cpu` backend's attention kernel against the `xla` backend's; (c) whole engines, one per
backend. Each timing is the best of a few rounds, the sides taking turns. Writes
results/bench_cpu_kernels.md.

    python scripts/bench_cpu_kernels.py [--rounds 3] [--parts matmul,attention,engine]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import Shape, make_inputs  # noqa: E402
from bench_common import (Workload, dummy_hf_checkpoint, make_engine, make_workload,  # noqa: E402
                          markdown_table, run_engine, write_result)

from jaxserve.kernels.cpu import (  # noqa: E402
    native as cpu_native,
    paged_attention as cpu_paged_attention,
)
from jaxserve.kernels.xla import attention as xla_attention  # noqa: E402

# Deleted once XLA's dot measured faster (issue 48); the other parts still run. Asked of the
# built library's targets, not of an import: an editable install's path can reach another tree.
cpu_matmul = (importlib.import_module("jaxserve.kernels.cpu_matmul")
              if "jaxserve_cpu_matmul" in cpu_native.TARGETS else None)

DECODE_ROWS = (1, 4, 16)
PREFILL_ROWS = (128, 512)
DOT = "LIBRARY_FUSION_TYPE_DOT"
# name -> XLA:CPU compiler options for jnp.dot (jaxlib 0.10.2's debug options, per compile)
XLA_VARIANTS = {
    "xla": {},
    "xla, YNNPACK off": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "xla + oneDNN": {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_fusion_type": DOT,
                     "xla_cpu_experimental_ynn_fusion_type": ""},
    "xla + XNNPACK": {"xla_cpu_use_xnnpack": True, "xla_cpu_experimental_xnn_fusion_type": DOT,
                      "xla_cpu_experimental_ynn_fusion_type": ""},
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    def dense_layers(self) -> dict[str, tuple[int, int]]:
        """[K, N] of each matmul as the native path runs it: q/k/v and gate/up fused."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"qkv": (self.hidden, q + 2 * kv), "o": (q, self.hidden),
                "gate_up": (self.hidden, 2 * self.intermediate),
                "down": (self.intermediate, self.hidden), "head": (self.hidden, self.vocab)}


MODELS = (ModelShape("dummy-30m", 512, 1408, 8, 4, 64, 8192),
          ModelShape("SmolLM2-135M", 576, 1536, 9, 3, 64, 49152))


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return "CPU flags unknown"
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    return ("CPU flags: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                                      for f in ("avx", "avx2", "fma"))
            + (f", AVX-512 yes ({' '.join(avx512)})" if avx512 else ", AVX-512 no"))


def best_ms(fn: Callable[[], jax.Array], budget_s: float = 0.2) -> float:
    """ms per call of one round: calls back to back for about `budget_s`, one wait at the end."""
    start = time.perf_counter()
    fn().block_until_ready()
    calls = max(1, int(budget_s / max(time.perf_counter() - start, 1e-6)))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    out.block_until_ready()
    return 1e3 * (time.perf_counter() - start) / calls


def alternate(sides: dict[str, Callable[[], jax.Array]], rounds: int) -> dict[str, float]:
    """Best ms per call of each side, the sides taking turns round after round."""
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            best[name] = min(best[name], best_ms(fn))
    return best


def dot_lowering(compiled: jax.stages.Compiled) -> str:
    """What XLA:CPU made of the dot: a library fusion (ynn/onednn/xnn) or its own emitter."""
    kinds = re.findall(r'"kind":"__(\w+?)_fusion"', compiled.as_text())
    return "+".join(sorted(set(kinds))) or "own"


def bench_matmul(rounds: int) -> str:
    rows, lowerings = [], {}
    for model in MODELS:
        for layer, (K, N) in model.dense_layers().items():
            rng = np.random.default_rng(0)
            w_np = rng.standard_normal((K, N), np.float32) / np.sqrt(K)
            w = jnp.asarray(w_np)
            packed = jnp.asarray(cpu_matmul.pack(w_np)) if cpu_matmul else None
            # The model's XLA path reads the head vocab-major, [V, D], as hidden @ head.T
            head = jnp.asarray(np.ascontiguousarray(w_np.T)) if layer == "head" else None
            for M in DECODE_ROWS + (() if layer == "head" else PREFILL_ROWS):
                x = jnp.asarray(rng.standard_normal((M, K), np.float32))
                sides, ref = {}, None
                for name, options in XLA_VARIANTS.items():
                    fn = (lambda x, h: x @ h.T) if head is not None else jnp.dot
                    args = (x, head if head is not None else w)
                    compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
                    lowerings[name] = dot_lowering(compiled)
                    sides[name] = functools.partial(compiled, *args)
                    ref = sides[name]() if ref is None else ref
                if packed is not None:
                    native = jax.jit(functools.partial(cpu_matmul.matmul, columns=N))
                    sides["native"] = functools.partial(native, x, packed)
                    np.testing.assert_allclose(sides["native"](), ref, rtol=1e-3, atol=1e-3)
                ms = alternate(sides, rounds)
                xla_best = min(v for k, v in ms.items() if k != "native")
                rows.append([model.name, layer, f"{K}x{N}", M]
                            + [1e3 * ms[name] for name in XLA_VARIANTS]
                            + ([1e3 * ms["native"], ms["native"] / xla_best]
                               if "native" in ms else []))
                print(rows[-1], flush=True)
    headers = (["model", "layer", "K x N", "rows M"] + [f"{n} (us)" for n in XLA_VARIANTS]
               + (["native (us)", "native / best xla"] if cpu_matmul else []))
    what = ", ".join(f"{name}: {lowerings[name]}" for name in XLA_VARIANTS)
    return (f"#### (a) Dense layers: native matmul (packed weights) vs XLA's dot, float32\n\n"
            f"Best of {rounds} rounds, us per call. The dot as XLA:CPU compiled it ({what}; "
            "`own`: XLA's own dot emitter, no library fusion). The head runs at decode rows "
            "only (a prefill computes logits for its last row).\n\n"
            + markdown_table(headers, rows))


def bench_attention(rounds: int) -> str:
    rows = []
    for model in MODELS:
        shapes = [Shape("decode 8 x 512 kv", (1,) * 8, (512,) * 8, model.num_heads,
                        model.num_kv_heads, model.head_dim),
                  Shape("decode 32 x 1024 kv", (1,) * 32, (1024,) * 32, model.num_heads,
                        model.num_kv_heads, model.head_dim),
                  Shape("prefill chunk 512", (512,), (512,), model.num_heads,
                        model.num_kv_heads, model.head_dim)]
        for shape in shapes:
            args = make_inputs(shape, jnp.float32)
            scale = shape.head_dim ** -0.5
            kernels = {"xla": jax.jit(functools.partial(xla_attention.ragged_paged_attention,
                                                        sm_scale=scale)),
                       "native": jax.jit(functools.partial(
                           cpu_paged_attention.ragged_paged_attention, sm_scale=scale))}
            sides = {name: functools.partial(k, *args) for name, k in kernels.items()}
            np.testing.assert_allclose(sides["native"](), sides["xla"](), rtol=1e-4, atol=1e-4)
            ms = alternate(sides, rounds)
            rows.append([model.name, shape.name, ms["xla"], ms["native"],
                         ms["native"] / ms["xla"]])
            print(rows[-1], flush=True)
    return ("#### (b) Attention: `cpu` backend's native kernel vs the `xla` backend's\n\n"
            f"Best of {rounds} rounds, ms per call, one layer.\n\n"
            + markdown_table(["model", "shape", "xla (ms)", "native (ms)", "native / xla"], rows))


def engine_workloads(model: str, vocab: int) -> list[Workload]:
    if model == "dummy-30m":
        return [make_workload("decode-heavy: 8 x (16 prompt + 64 out)", 8, (16, 16), (64, 64),
                              vocab, seed=1),
                make_workload("prefill-heavy: 2 x (256 prompt + 1 out)", 2, (256, 256), (1, 1),
                              vocab, seed=2)]
    return [make_workload("decode-heavy: 8 x (16 prompt + 16 out)", 8, (16, 16), (16, 16),
                          vocab, seed=1),
            make_workload("prefill-heavy: 1 x (128 prompt + 1 out)", 1, (128, 128), (1, 1),
                          vocab, seed=2)]


def bench_engine(rounds: int) -> str:
    from jaxserve.default_model import smollm2_gguf_path

    models = {"dummy-30m": (dummy_hf_checkpoint(), 8192)}
    smol = smollm2_gguf_path()
    if smol is not None:
        models["SmolLM2-135M (Q4_1 GGUF, f32)"] = (smol, 49152)
    rows = []
    for model, (path, vocab) in models.items():
        engines = {b: make_engine(path, attention_backend=b, compilation_cache_dir="",
                                  max_num_seqs=8, dtype="float32", enable_prefix_caching=False)
                   for b in ("xla", "cpu")}
        for workload in engine_workloads(model.split(" ")[0], vocab):
            warm = Workload("warm", workload.prompts, [min(n, 3) for n in workload.output_lens])
            for engine in engines.values():  # compiles this workload's buckets
                run_engine(engine, warm, prefix="warm")
            best = {b: float("inf") for b in engines}
            outputs = {}
            for r in range(rounds):
                for b, engine in engines.items():
                    result = run_engine(engine, workload, prefix=f"r{r}")
                    best[b] = min(best[b], result.elapsed_s)
                    outputs[b] = sorted(list(o.outputs[0].token_ids) for o in result.outputs)
            tokens = sum(len(p) for p in workload.prompts) + workload.num_output_tokens
            rows.append([model, workload.name, best["xla"], best["cpu"], best["cpu"] / best["xla"],
                         tokens / best["xla"], tokens / best["cpu"],
                         "yes" if outputs["xla"] == outputs["cpu"] else "no"])
            print(rows[-1], flush=True)
        del engines
    return ("#### (c) Whole engine: `attention_backend='cpu'` vs `'xla'`\n\n"
            f"Best of {rounds} runs each, the engines taking turns after a warm-up run that "
            "compiled the workload's buckets; greedy, float32, max_num_seqs 8, prefix caching "
            "off (every run prefills its whole prompts). `cpu` runs "
            + ("the native attention and the native matmul" if cpu_matmul else
               "the native attention with XLA's dots (the native matmul is deleted)")
            + ".\n\n" + markdown_table(
                ["model", "workload", "xla (s)", "cpu (s)", "cpu / xla", "xla tok/s",
                 "cpu tok/s", "same tokens"], rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--parts", default="matmul,attention,engine")
    parser.add_argument("--name", default="bench_cpu_kernels", help="results/<name>.md")
    opts = parser.parse_args()
    if not cpu_native.available():
        raise SystemExit("the native CPU kernels did not build here: nothing to compare")
    parts = opts.parts.split(",")
    sections = [cpu_flags() + "."]
    if "matmul" in parts:
        sections.append(bench_matmul(opts.rounds) if cpu_matmul else
                        "#### (a) Dense layers\n\nThe native matmul is deleted (issue 48).")
    if "attention" in parts:
        sections.append(bench_attention(opts.rounds))
    if "engine" in parts:
        sections.append(bench_engine(opts.engine_rounds))
    write_result(opts.name, "Native CPU kernels vs XLA:CPU", "\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
