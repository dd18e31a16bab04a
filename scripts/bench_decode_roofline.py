"""Decode step time of the dummy ~30M Llama against the memory-bandwidth bound (and, since a CPU
runs out of FLOPs first at larger batches, the compute bound).

A decode step must read every weight once (the embedding only for its rows) and each
sequence's KV; at the machine's measured bandwidth that takes at least `bytes / bandwidth`.
Bandwidth: the best of a numpy copy (bytes read + written) and a jitted jax reduction (bytes
read) over arrays far larger than the caches. Compute: 2 FLOPs per weight per token plus the
attention's 4 x heads x head_dim x context per layer and token, at the GFLOP/s of a large jitted
float32 matmul. Both rates are measured just before and just after each row's step timing and
the better of the two is that row's bound: on a shared machine they swing by 2x over minutes,
and a bound measured at another moment than the step says little about the step. The whole
pass runs `--rounds` times; each row keeps its best round's times and rates (the same step
took 11 ms and 15 ms a few minutes apart here).

Each attention backend (`--backends`, default the CPU's two: `cpu`, whose attention runs in
the native kernel, and the pure-JAX `xla`) gets its own engine, measured in the same run.

    python scripts/bench_decode_roofline.py [--batches 1,8,32,64] [--contexts 128,512]
        [--backends cpu,xla] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from bench_common import (DUMMY_CONFIG_DIR, device_only_ms, fill_decoding,
                          last_level_cache_bytes, make_engine, markdown_table, timed_steps_ms,
                          write_result)


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """GB/s of a numpy copy (read + write counted) and of a jax sum (read)."""
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    copy = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        copy.append(time.perf_counter() - start)
    x = jnp.ones(n, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    read = []
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        read.append(time.perf_counter() - start)
    return {"numpy copy": 2 * src.nbytes / min(copy) / 1e9,
            "jax sum (read)": x.nbytes / min(read) / 1e9}


def measure_matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def measure_rates() -> tuple[float, float]:
    """(GB/s, GFLOP/s) of the machine now."""
    return max(measure_bandwidth().values()), measure_matmul_gflops()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="128,512")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backends", default="cpu,xla")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    steps = []
    for backend in args.backends.split(","):
        steps += best_rounds(measure_backend(backend, batches, contexts, args.steps,
                                             args.rounds))
    cache = last_level_cache_bytes()
    rows = [roofline_row(step, cache) for step in steps]
    gbps, gflops = [t.gbps for t in steps], [t.gflops for t in steps]

    body = ("dummy ~30M Llama (8 layers, hidden 512, 4 KV heads x 64, vocab 8192), float32. "
            "Each row's bound uses the machine's rates measured just before and just after its "
            "step timing, the better of the two (GB/s: the better of a numpy copy and a jax "
            "sum over 512 MiB; GFLOP/s: a jitted 1024x1024 float32 matmul). Across rows they "
            f"ranged {min(gbps):.1f}-{max(gbps):.1f} GB/s and {min(gflops):.0f}-"
            f"{max(gflops):.0f} GFLOP/s. "
            + (f"Largest CPU cache: {cache / 2**20:.0f} MiB; a memory bound marked (fits cache) "
               "is not a bound: the step's bytes fit in the cache, so its weights need not come "
               "from DRAM each step." if cache else "CPU cache size unknown.")
            + "\n\n"
            + markdown_table(["attention backend", "batch", "context", "engine step ms",
                              "device-only ms", "weights MiB", "KV MiB", "GB/s", "GFLOP/s",
                              "memory bound ms", "compute bound ms", "memory bound / device-only",
                              "roofline / device-only", "roofline / step"], rows)
            + "\n\ncontext = prompt tokens; the KV and attention FLOPs count each request's "
            "tokens at the measured step (the first requests decode while the last ones "
            "prefill, so they run longer). memory bound = (weights + the batch's embedding rows "
            "+ KV of every sequence) "
            "/ bandwidth; compute bound = FLOPs / matmul rate; roofline = the larger; "
            "device-only = the jitted step replayed on inputs already on the device (best of 20, "
            f"ModelRunner.time_last_step); each row: the best of {args.rounds} rounds of the "
            "whole table (times and rates each at their best); engine step "
            "= the whole LLMEngine.step (host work included). A percentage is the share of the "
            "bound reached (100% = at the bound). `cpu`: attention in the native kernel "
            "(jaxserve/kernels/cpu/paged_attention.cc), dense layers in XLA; `xla`: all in XLA.")
    write_result("bench_decode_roofline", "Decode step against the memory-bandwidth bound", body)


@dataclasses.dataclass
class StepTime:
    backend: str
    batch: int
    context: int
    step_ms: float  # the whole LLMEngine.step
    device_ms: float  # the jitted step alone
    weight_bytes: int
    kv_bytes: int
    moved_bytes: int  # weights, the batch's embedding rows and its KV
    flops: float
    gbps: float  # the machine's rates next to this row's timing
    gflops: float


def measure_backend(backend: str, batches: list[int], contexts: list[int],
                    steps: int, rounds: int) -> list[StepTime]:
    from jaxserve.models.loader import load_model

    # A request's context grows by a token a step while later ones prefill (one a step at most:
    # a prompt fills max_num_batched_tokens), then by the timed steps.
    blocks_per_seq = -(-(max(contexts) + max(batches) + 2 * steps + 16) // 16)
    engine = make_engine(DUMMY_CONFIG_DIR, load_format="dummy", dtype="float32",
                         max_model_len=1024, block_size=16,
                         num_kv_blocks=max(batches) * blocks_per_seq + 1,
                         max_num_seqs=max(batches), max_num_batched_tokens=512,
                         token_buckets=sorted({*batches, 512}), request_buckets=batches,
                         enable_prefix_caching=False, precompile=True,
                         attention_backend=backend)
    cfg = engine.core.model_config
    params = load_model(str(DUMMY_CONFIG_DIR), "dummy").params  # the weights as loaded
    weight_bytes = sum(v.nbytes for k, v in params.items() if k != "embed")
    embed_row_bytes = params["embed"].nbytes // cfg.vocab_size
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    flops_per_token = 2 * sum(v.size for k, v in params.items() if k != "embed")
    del params
    measured = []
    for ctx, b, round_ in ((c, b, r) for r in range(rounds) for c in contexts for b in batches):
        ids = fill_decoding(engine, b, ctx, cfg.vocab_size, prefix=f"r{round_}b{b}c{ctx}-")
        timed_steps_ms(engine, 1)
        before = measure_rates()
        step_ms = timed_steps_ms(engine, steps)["step"]
        device_ms = device_only_ms(engine, repeats=20)
        gbps, gflops = (max(pair) for pair in zip(before, measure_rates()))
        running = engine.core.scheduler.running
        if len(running) != b:
            raise RuntimeError(f"batch {b}: {len(running)} requests in the step")
        context_tokens = sum(r.num_tokens for r in running)
        kv_bytes = context_tokens * kv_token_bytes
        attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_tokens
        measured.append(StepTime(backend, b, ctx, step_ms, device_ms, weight_bytes,
                                 kv_bytes, weight_bytes + b * embed_row_bytes + kv_bytes,
                                 b * flops_per_token + attn_flops, gbps, gflops))
        engine.abort_request(ids)
        engine.step()
    return measured


def best_rounds(times: list[StepTime]) -> list[StepTime]:
    """Each (backend, batch, context) once: its fastest step and device times and best rates
    over the rounds."""
    best: dict[tuple[str, int, int], StepTime] = {}
    for t in times:
        key = (t.backend, t.batch, t.context)
        b = best.setdefault(key, t)
        best[key] = dataclasses.replace(b, step_ms=min(b.step_ms, t.step_ms),
                                        device_ms=min(b.device_ms, t.device_ms),
                                        gbps=max(b.gbps, t.gbps), gflops=max(b.gflops, t.gflops))
    return list(best.values())


def roofline_row(t: StepTime, cache_bytes: int) -> list[object]:
    bound_ms = t.moved_bytes / (t.gbps * 1e9) * 1e3
    compute_ms = t.flops / (t.gflops * 1e9) * 1e3
    roof = max(bound_ms, compute_ms)
    fits = " (fits cache)" if t.moved_bytes <= cache_bytes else ""
    return [t.backend, t.batch, t.context, t.step_ms, t.device_ms, t.weight_bytes / 2**20,
            t.kv_bytes / 2**20, t.gbps, t.gflops, f"{bound_ms:.3g}{fits}", compute_ms,
            f"{100 * bound_ms / t.device_ms:.0f}%", f"{100 * roof / t.device_ms:.0f}%",
            f"{100 * roof / t.step_ms:.0f}%"]


if __name__ == "__main__":
    main()
