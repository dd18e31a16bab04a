"""Output tokens/s of jaxserve against HF transformers at its best, same weights, same workload.

Both engines get the same concurrency (`--max-num-seqs`). HF runs (a) `generate` over static
batches at each of several batch sizes up to that (each batch generates to its longest request,
EOS ignored, as a `generate` user must; the best batch size counts) and (b) its own
continuous-batching manager (`continuous_batching_context_manager`, per-request max_new_tokens).
HF uses whichever torch thread count (1 or 2) a short probe finds faster: on a busy 2-core
machine, 2 OpenMP threads can be 5-10x slower than 1. Start-up work is excluded for everyone:
jaxserve precompiles, HF warms up.

    python scripts/bench_throughput_vs_hf.py [--models dummy-30m,dummy-moe,stories260k]
    python scripts/bench_throughput_vs_hf.py --suite large-batch   # concurrency 64, HF B=32/64

Suites: `default` (mixed and decode-heavy at a per-model concurrency of 8 or 16) and
`large-batch` (concurrency 64, HF's static batches of 32 and 64, four workloads: mixed prompts
with 128 outputs, a shared 448-token prefix, decode-heavy, and prompts and outputs both varied),
written to results/bench_throughput_vs_hf_large_batch.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import (Workload, dummy_hf_checkpoint, fastest_torch_threads, find_stories,
                          make_engine, make_workload, markdown_table, run_engine,
                          stories_hf_checkpoint, write_result)

# Buckets from 1 (CPU tuning, as in configs/engine/cpu-*.yaml): the last one or two requests of
# a run no longer pay for 8 padded rows in every matmul (~7% on the dummy model's mixed run).
ENGINE_ARGS = dict(load_format="hf", dtype="float32", max_model_len=512, block_size=16,
                   num_kv_blocks=1024, max_num_batched_tokens=512,
                   token_buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512], precompile=True)
# Per suite and model: requests per workload, concurrency, HF batch sizes; the default suite is
# sized so that the dummy model (~100x the compute of stories260K per token) also finishes in a
# few minutes.
MODEL_DEFAULTS = {
    "default": {
        "dummy-30m": dict(mixed_requests=16, decode_requests=8, max_num_seqs=8,
                          hf_batch_sizes=[4, 8]),
        "dummy-moe": dict(mixed_requests=16, decode_requests=8, max_num_seqs=8,
                          hf_batch_sizes=[4, 8]),
        "stories260k": dict(mixed_requests=48, decode_requests=32, max_num_seqs=16,
                            hf_batch_sizes=[4, 8, 16]),
    },
    "large-batch": {
        name: dict(mixed_requests=64, decode_requests=32, max_num_seqs=64, hf_batch_sizes=[32, 64])
        for name in ("dummy-30m", "dummy-moe", "stories260k")},
}
# 64 sequences of up to 512 tokens fit without preemption.
SUITE_ENGINE_ARGS = {"default": {}, "large-batch": {"num_kv_blocks": 2048}}
SHARED_PREFIX_LEN = 448


@dataclass
class HFResult:
    label: str
    seconds: float
    output_tokens: int  # useful tokens (what the requests asked for)
    token_ids: list[list[int]] | None = None

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds


def workloads(args: argparse.Namespace, vocab: int, seed: int) -> list[Workload]:
    if args.suite == "default":
        return [make_workload("mixed", args.mixed_requests, (16, 256), (16, 256), vocab, seed),
                make_workload("decode-heavy", args.decode_requests, (32, 32), (256, 256), vocab,
                              seed + 1)]
    shared = make_workload("shared-prefix", args.decode_requests, (32, 32), (16, 16), vocab,
                           seed + 2)
    prefix = make_workload("prefix", 1, (SHARED_PREFIX_LEN, SHARED_PREFIX_LEN), (1, 1), vocab,
                           seed + 3).prompts[0]
    shared.prompts = [prefix + p for p in shared.prompts]
    return [make_workload("mixed", args.mixed_requests, (16, 256), (128, 128), vocab, seed),
            shared,
            make_workload("decode-heavy", args.decode_requests, (32, 32), (256, 256), vocab,
                          seed + 1),
            make_workload("varied", args.mixed_requests, (16, 256), (16, 224), vocab, seed + 4)]


def pick_torch_threads(model: Any, batch_size: int, vocab: int) -> int:
    import torch

    ids = torch.randint(3, vocab, (batch_size, 32))
    return fastest_torch_threads(lambda: model.generate(
        ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
        pad_token_id=0))


def hf_static(model: Any, w: Workload, batch_size: int) -> HFResult:
    import torch

    outs: list[list[int]] = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(w.prompts), batch_size):
            prompts, lens = w.prompts[i:i + batch_size], w.output_lens[i:i + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            outs += [gen[j, width:width + n].tolist() for j, n in enumerate(lens)]
    return HFResult(f"static bs={batch_size}", time.perf_counter() - start, w.num_output_tokens,
                    outs)


def hf_continuous(model: Any, w: Workload, max_batch_tokens: int, max_seqs: int) -> HFResult:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                  max_new_tokens=max(w.output_lens))
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens,
                                         max_requests_per_batch=max_seqs)
    hints = WorkloadHints(max_prompt_length=max(map(len, w.prompts)),
                          max_generated_length=max(w.output_lens), num_requests=len(w.prompts))
    with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True,
            timeout=30, workload_hints=hints) as manager:  # warm-up happens on entry
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(w.prompts, w.output_lens)]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=5)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped early")
        seconds = time.perf_counter() - start
    tokens = [list(results[i].generated_tokens) for i in ids]
    return HFResult("continuous batching", seconds, sum(map(len, tokens)), tokens)


def near_tie_gaps(model: Any, prompts: list[list[int]], ours: list[list[int]],
                  theirs: list[list[int]]) -> list[float]:
    """For each request whose tokens differ: HF's logit gap, at the first differing position,
    between the token HF chose and ours (a float32 tie that another summation order breaks the
    other way is ~1e-6)."""
    import torch

    gaps = []
    for prompt, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + a[:j]])).logits[0, -1]
        gaps.append(float(logits[b[j]] - logits[a[j]]))
    return gaps


def bench_model(name: str, hf_dir: Path, cli: argparse.Namespace) -> tuple[list, list]:
    import torch
    import transformers

    defaults = MODEL_DEFAULTS[cli.suite][name]
    args = argparse.Namespace(**{**vars(cli), **{k: v for k, v in defaults.items()
                                                 if getattr(cli, k) is None}})

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = hf.config.vocab_size
    seqs = args.max_num_seqs
    engine = make_engine(hf_dir, max_num_seqs=seqs,
                         request_buckets=sorted({min(b, seqs) for b in (1, 2, 4, 8, 16, 32, 64)}),
                         **{**ENGINE_ARGS, **SUITE_ENGINE_ARGS[args.suite]})
    warm = make_workload("warm-up", 4, (16, 64), (4, 8), vocab, seed=99)
    run_engine(engine, warm, prefix="warm")
    threads = pick_torch_threads(hf, seqs, vocab)
    hf_static(hf, warm, 4)

    # Each repeat runs every engine on a fresh seeded workload (fresh prompts: no prefix-cache
    # hits from the previous repeat); engines alternate, so load drifts hit all of them alike.
    runs: dict[str, dict[str, list[HFResult]]] = {}
    same: dict[str, int] = {}
    gaps: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for w in workloads(args, vocab, args.seed + 10 * rep):
            if w.name not in args.workloads:
                continue
            js = run_engine(engine, w, prefix=f"{w.name}{rep}-")
            js_tokens = [None] * len(w.prompts)
            for o in js.outputs:
                js_tokens[int(o.request_id.rsplit("-", 1)[1])] = o.outputs[0].token_ids
            results = [HFResult("jaxserve", js.elapsed_s, js.output_tokens, js_tokens)]
            results += [hf_static(hf, w, bs) for bs in args.hf_batch_sizes if bs <= seqs]
            if not args.skip_hf_cb:
                try:
                    results.append(hf_continuous(hf, w, ENGINE_ARGS["max_num_batched_tokens"],
                                                 seqs))
                except Exception as e:  # noqa: BLE001 (report it, keep the rest of the table)
                    print(f"HF continuous batching failed on {name}/{w.name}: {e!r}")
            for r in results:
                runs.setdefault(w.name, {}).setdefault(r.label, []).append(r)
            # Greedy tokens must agree with every HF run, whichever is fastest; where one does
            # not, how close to a tie HF's own logits were there.
            same[w.name] = same.get(w.name, 0) + min(
                sum(a == b for a, b in zip(js_tokens, r.token_ids)) for r in results[1:])
            for r in results[1:]:
                gaps.setdefault(w.name, []).extend(
                    near_tie_gaps(hf, w.prompts, js_tokens, r.token_ids))

    summary, detail = [], []
    for wname, by_label in runs.items():
        median = {label: statistics.median(r.throughput for r in rs)
                  for label, rs in by_label.items()}
        best = max((label for label in median if label != "jaxserve"), key=median.get)
        first = by_label["jaxserve"][0]
        summary.append([name, wname, len(first.token_ids), seqs,
                        sum(r.output_tokens for r in by_label["jaxserve"]),
                        median["jaxserve"], median[best], best, median["jaxserve"] / median[best],
                        f"{same[wname]}/{len(first.token_ids) * args.repeats}"
                        + (f" (differing: HF logit gap at the first difference <= "
                           f"{max(gaps[wname]):.1e})" if gaps.get(wname) else "")])
        for label, rs in by_label.items():
            engine_name = label if label == "jaxserve" else f"HF {label} ({threads} thr)"
            detail.append([name, wname, engine_name, ", ".join(f"{r.seconds:.2f}" for r in rs),
                           median[label]])
    return summary, detail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dummy-30m,dummy-moe,stories260k")
    p.add_argument("--suite", choices=list(MODEL_DEFAULTS), default="default")
    p.add_argument("--workloads", default=None,
                   help="default: all of the suite's (mixed,decode-heavy; large-batch adds "
                        "shared-prefix,varied)")
    p.add_argument("--mixed-requests", type=int, default=None, help="default: per model")
    p.add_argument("--decode-requests", type=int, default=None, help="default: per model")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="concurrency of both engines (default: per model)")
    p.add_argument("--hf-batch-sizes", default=None, help="e.g. 4,8,16; capped at "
                   "--max-num-seqs (default: per model)")
    p.add_argument("--skip-hf-cb", action="store_true", help="skip HF continuous batching")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of every engine, each on fresh prompts; the table shows medians")
    args = p.parse_args()
    if args.hf_batch_sizes is not None:
        args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    args.workloads = (args.workloads or "mixed,shared-prefix,decode-heavy,varied").split(",")
    summary, detail = [], []
    for name in args.models.split(","):
        if name in ("dummy-30m", "dummy-moe"):
            hf_dir = dummy_hf_checkpoint(name=name)
        elif name == "stories260k":
            stories = find_stories()
            if stories is None:
                print("stories260K not found: skipped")
                continue
            hf_dir = stories_hf_checkpoint(stories)
        else:
            raise ValueError(f"--models: unknown model {name!r} (dummy-30m, dummy-moe, "
                             "stories260k)")
        s, d = bench_model(name, hf_dir, args)
        summary += s
        detail += d
    described = {
        "default": "mixed: prompts and outputs uniform in 16-256 tokens; decode-heavy: 32-token "
                   "prompts, 256 output tokens.",
        "large-batch": "mixed: prompts uniform in 16-256 tokens, 128 output tokens each; "
                       f"shared-prefix: a common {SHARED_PREFIX_LEN}-token prefix and 32 tokens "
                       "of each prompt's own, 16 output tokens; decode-heavy: 32-token prompts, "
                       "256 output tokens; varied: prompts in 16-256, outputs in 16-224 tokens.",
    }[args.suite]
    body = ("Both engines get the same concurrency (column): jaxserve's max_num_seqs, HF's "
            "largest static batch and its continuous batching's max_requests_per_batch. Greedy, "
            f"EOS ignored; {described} Every engine runs each workload "
            f"{args.repeats} times on fresh seeded prompts, engines alternating; tok/s are "
            "medians. Ratio = jaxserve / best HF. Same greedy tokens: requests whose jaxserve "
            "output equals every HF run's; where one does not, the largest gap, in HF's own "
            "logits at the first differing position, between HF's token and jaxserve's (float32 "
            "ties that another summation order breaks the other way are ~1e-6).\n\n"
            + markdown_table(["model", "workload", "requests", "concurrency",
                              "output tokens (all repeats)",
                              "jaxserve tok/s",
                              "best HF tok/s", "best HF", "ratio", "same greedy tokens"], summary)
            + "\n\nEvery run, side by side (seconds exclude start-up/warm-up):\n\n"
            + markdown_table(["model", "workload", "engine", "seconds per repeat",
                              "median output tok/s"], detail))
    suffix = "" if args.suite == "default" else "_" + args.suite.replace("-", "_")
    write_result("bench_throughput_vs_hf" + suffix, "Throughput against HF transformers"
                 + ("" if args.suite == "default" else f" ({args.suite})"), body)


if __name__ == "__main__":
    main()
