"""Speculative decoding: output tokens/s with it off against each proposer, side by side.

One process, one engine per proposer (speculation off, ngram prompt lookup, layer_skip
self-speculation from the target's first half of layers, draft_model with the target itself
as the draft), all holding the same weights. For
each model, workload and batch size every engine gets a warm-up run of the very workload it
is then timed on (every program is compiled at start: precompile), then `--repeats` timed runs,
engines alternating so that a shared machine's drift hits all of them alike; the best run
counts. Greedy, EOS ignored, fixed output lengths: every engine must produce the same tokens.

Workloads: (a) repetition, whose outputs copy spans of the prompt (quoting a document, editing
code): for stories260K, greedy stories generated from short openers, each prompt a story, BOS
(how TinyStories separates stories) and the story's first tokens again, so the model's own
continuation retells it; for the dummy model (random weights, whose greedy outputs loop
anyway), a random span repeated three times after a random prefix. (b) mixed: random prompts
and output lengths (bench_throughput_vs_hf's mixed row, smaller).

Batch b: b requests submitted together (an engine of max_num_seqs = the largest batch runs them
at once), `--waves` such groups one after the other in a timed run.

    python scripts/bench_spec_decode.py [--models dummy,stories] [--batches 1,8]
    python scripts/bench_spec_decode.py --quick --models dummy    # a smoke run
    python scripts/bench_spec_decode.py --proposers off,off-sync,ngram --ngram-lookup 2-4

`off-sync` (on request): off without async scheduling, to tell what the overlap of host and
device work is worth.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench_common import (Workload, dummy_hf_checkpoint, find_stories, make_engine, make_workload,
                          markdown_table, run_engine, stories_hf_checkpoint, write_result)

# Buckets from 1 (as in bench_throughput_vs_hf): a batch-1 decode step without drafts must not
# pay for padded rows that a drafting step fills. No prefix caching: every run of a workload
# (warm-up, repeats) does the same prefill work. Precompile: which steps draft depends on
# timing (the adaptive switch), so a warm-up run need not meet every shape a timed run does.
ENGINE_ARGS = dict(load_format="hf", dtype="float32", block_size=16,
                   enable_prefix_caching=False, precompile=True)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512)  # few: every engine compiles them all
REQUEST_BUCKETS = (1, 8, 16, 32, 64)
SIZES = {  # full run / --quick
    False: dict(max_model_len=512, num_kv_blocks=512, max_num_batched_tokens=512,
                max_tokens=128, repeats=6, waves=2, span=32, prefix=16, mixed_prompt=(16, 256),
                story_extra=40, cut=8),
    True: dict(max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=256,
               max_tokens=24, repeats=1, waves=1, span=8, prefix=8, mixed_prompt=(8, 48),
               story_extra=16, cut=4),
}
# k = 5, n up to 4: vLLM's documented n-gram example
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4}
LAYER_SKIP_K = 3
DRAFT_MODEL_K = 3
OPENERS = ("Once upon a time", "One day, a little girl", "Tom had a big red ball",
           "The sun was shining", "Lily wanted to", "There was a small bird",
           "Ben and his mom went to", "A little dog named Max")
GOAL_SPEEDUP, GOAL_SLOWDOWN = 2.0, 0.95


def proposers(hf_dir: Path, num_layers: int, args: argparse.Namespace,
              ) -> dict[str, dict[str, Any] | None]:
    """label -> speculative_config (None: off). "off-sync": off without async scheduling, only
    on request (--proposers). draft_model: the target is its
    own draft (no smaller model of these vocabularies is at hand; a random one would never be
    accepted), so every greedy draft is accepted at the cost of a second full model."""
    half = args.layer_skip_layers or max(1, num_layers // 2)
    lookup_min, lookup_max = (int(n) for n in args.ngram_lookup.split("-"))
    ngram = {**NGRAM, "num_speculative_tokens": args.ngram_k, "prompt_lookup_min": lookup_min,
             "prompt_lookup_max": lookup_max}
    return {
        "off": None,
        "off-sync": None,
        f"ngram (k={ngram['num_speculative_tokens']}, n={lookup_min}-{lookup_max})": ngram,
        "ngram-always (no adaptive switch)": {**ngram, "adaptive": False},
        f"layer_skip (k={LAYER_SKIP_K}, {half} of {num_layers} layers)":
            {"method": "layer_skip", "num_speculative_tokens": LAYER_SKIP_K, "num_layers": half},
        f"draft_model (k={DRAFT_MODEL_K}, draft = the target itself)":
            {"method": "draft_model", "model": str(hf_dir),
             "num_speculative_tokens": DRAFT_MODEL_K},
    }


# ---- workloads ----------------------------------------------------------------------------
# Request i of a workload is the same whatever the number of requests (--batches, --waves):
# batch 1's request is batch 8's first.
def repetition_dummy(n: int, vocab: int, size: dict, max_tokens: int, seed: int) -> Workload:
    prompts = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        span = rng.integers(3, vocab, size["span"]).tolist()
        prompts.append(rng.integers(3, vocab, size["prefix"]).tolist() + span * 3)
    return Workload("repetition", prompts, [max_tokens] * n)


def mixed_workload(n: int, vocab: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int) -> Workload:
    parts = [make_workload("mixed", 1, prompt_len, output_len, vocab, seed=[seed, i])
             for i in range(n)]
    return Workload("mixed", [w.prompts[0] for w in parts], [w.output_lens[0] for w in parts])


def stories_docs(engine: Any, stories_bin: Path, story_len: int) -> list[list[int]]:
    """Greedy stories (without BOS) from the openers, generated by `engine`."""
    from jaxserve.models.llama2c_loader import llama2c_tokenizer

    tok = llama2c_tokenizer(stories_bin.parent / "tok512.bin", 512)
    openers = [tok.encode(text) for text in OPENERS]  # BOS first
    run = run_engine(engine, Workload("story", openers, [story_len] * len(openers)),
                     prefix="story-")
    generated = {int(o.request_id.rsplit("-", 1)[1]): list(o.outputs[0].token_ids)
                 for o in run.outputs}
    docs = [openers[i][1:] + generated[i] for i in range(len(openers))]
    print("stories260K story 0:", repr(tok.decode(docs[0])[:300]), "...", flush=True)
    return docs


def repetition_stories(n: int, docs: list[list[int]], size: dict, max_tokens: int,
                       bos: int = 1) -> Workload:
    """Request i: story i (cycling, each further round quoting more of it), BOS, its first
    tokens again; the natural continuation copies the rest."""
    prompts = []
    for i in range(n):
        doc = docs[i % len(docs)]
        cut = size["cut"] * (1 + i // len(docs))
        prompts.append([bos] + doc + [bos] + doc[:cut])
    return Workload("repetition", prompts, [max_tokens] * n)


def waves_of(w: Workload, batch: int, waves: int) -> list[Workload]:
    """The first batch * waves requests of `w`, as `waves` groups of `batch`."""
    return [Workload(w.name, w.prompts[k * batch:(k + 1) * batch],
                     w.output_lens[k * batch:(k + 1) * batch]) for k in range(waves)]


# ---- runs ---------------------------------------------------------------------------------
@dataclass
class Run:
    wall_s: float
    cpu_s: float
    output_tokens: int
    steps: int
    compilations: int
    token_ids: list[list[int]]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


def spec_counts(engine: Any) -> tuple[int, int, int]:
    s = engine.stats().spec_decoding
    return (0, 0, 0) if s is None else (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def run_waves(engine: Any, waves: list[Workload], tag: str) -> Run:
    """Each wave's requests submitted together, the next wave once it finished; summed."""
    before = spec_counts(engine)
    total = Run(0.0, 0.0, 0, 0, 0, [])
    for k, wave in enumerate(waves):
        prefix = f"{tag}-{k}-"
        r = run_engine(engine, wave, prefix=prefix)
        ids: list[list[int]] = [[] for _ in wave.prompts]
        for o in r.outputs:
            ids[int(o.request_id[len(prefix):])] = list(o.outputs[0].token_ids)
        total.wall_s += r.elapsed_s
        total.cpu_s += r.cpu_s
        total.output_tokens += r.output_tokens
        total.steps += r.num_steps
        total.compilations += r.num_compilations
        total.token_ids += ids
    after = spec_counts(engine)
    total.drafts, total.draft_tokens, total.accepted = (a - b for a, b in zip(after, before))
    return total


@dataclass
class Config:
    label: str
    spec: dict[str, Any] | None
    engine: Any = None
    error: str | None = None  # "not available: ..." or "failed: ..."
    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)
    warm: dict[tuple[str, int], Run] = field(default_factory=dict)


def build(cfg: Config, hf_dir: Path, size: dict, max_batch: int) -> None:
    args = {k: size[k] for k in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens")}
    if cfg.label == "off-sync":
        args["async_scheduling"] = False
    buckets = [b for b in TOKEN_BUCKETS if b <= args["max_num_batched_tokens"]]
    if cfg.spec is not None:  # as the engine's default buckets: a batch-1 verify step unpadded
        buckets = sorted({*buckets, 1 + cfg.spec["num_speculative_tokens"]})
    try:
        cfg.engine = make_engine(hf_dir, max_num_seqs=max_batch, token_buckets=buckets,
                                 request_buckets=sorted({min(b, max_batch)
                                                         for b in REQUEST_BUCKETS}),
                                 speculative_config=cfg.spec, **args, **ENGINE_ARGS)
    except (ValueError, NotImplementedError) as e:
        if cfg.spec is None:
            raise
        cfg.error = f"not available: {type(e).__name__}: {e}"
        print(f"{cfg.label}: {cfg.error}", flush=True)


def guarded_run(cfg: Config, waves: list[Workload], tag: str) -> Run | None:
    """A proposer that fails at run time (engine work in progress) is reported, not fatal."""
    if cfg.engine is None:
        return None
    try:
        return run_waves(cfg.engine, waves, tag)
    except Exception as e:  # noqa: BLE001 (record it, keep the rest of the table)
        if cfg.spec is None:
            raise
        cfg.error = f"failed: {type(e).__name__}: {e}"
        print(f"{cfg.label}: {cfg.error}", flush=True)
        cfg.engine = None
        return None


def bench_model(name: str, hf_dir: Path, stories_bin: Path | None, args: argparse.Namespace,
                size: dict) -> tuple[list[list[Any]], list[str]]:
    import json

    hf_config = json.loads((hf_dir / "config.json").read_text())
    vocab, num_layers = hf_config["vocab_size"], hf_config["num_hidden_layers"]
    max_batch = max(args.batches)
    n = max_batch * args.waves
    wanted = args.proposers or {"off", "ngram", "ngram-always", "layer_skip", "draft_model"}
    configs = [Config(label, spec) for label, spec in proposers(hf_dir, num_layers, args).items()
               if label.split(" ")[0] in wanted]
    if configs[0].label != "off":
        configs.insert(0, Config("off", None))  # the baseline every ratio needs
    for cfg in configs:
        build(cfg, hf_dir, size, max_batch)

    if stories_bin is not None:
        docs = stories_docs(configs[0].engine, stories_bin, args.max_tokens + size["story_extra"])
        repetition = repetition_stories(n, docs, size, args.max_tokens)
    else:
        repetition = repetition_dummy(n, vocab, size, args.max_tokens, args.seed)
    mixed = mixed_workload(n, vocab, size["mixed_prompt"],
                           (max(1, args.max_tokens // 4), args.max_tokens), args.seed + 1)

    rows: list[list[Any]] = []
    notes: list[str] = []
    for w in (repetition, mixed):
        for batch in args.batches:
            key = (w.name, batch)
            waves = waves_of(w, batch, args.waves)
            for cfg in configs:
                start = time.perf_counter()
                run = guarded_run(cfg, waves, f"warm-{w.name}-{batch}")
                if run is not None:
                    cfg.warm[key] = run
                    print(f"{name} {w.name} b={batch} {cfg.label}: warm-up "
                          f"{time.perf_counter() - start:.1f} s", flush=True)
            for rep in range(args.repeats):
                for cfg in configs:
                    run = guarded_run(cfg, waves, f"r{rep}-{w.name}-{batch}")
                    if run is not None:
                        cfg.runs.setdefault(key, []).append(run)
                        print(f"{name} {w.name} b={batch} {cfg.label}: "
                              f"{run.output_tokens / run.wall_s:.1f} tok/s, "
                              f"{run.steps} steps", flush=True)
            off_runs = configs[0].runs[key]
            off_wall = max(r.output_tokens / r.wall_s for r in off_runs)
            off_cpu = max(r.output_tokens / r.cpu_s for r in off_runs)
            reference = off_runs[0].token_ids
            for cfg in configs:
                runs = cfg.runs.get(key, [])
                if len(runs) < args.repeats:  # unavailable, or failed on the way
                    status = (cfg.error or "failed").split(":")[0]
                    rows.append([name, w.name, batch, cfg.label, status, "—", "—", "—", "—",
                                 "—", "—"])
                    note = f"{name} {cfg.label}: {cfg.error}"
                    if note not in notes:
                        notes.append(note)
                    continue
                wall = max(r.output_tokens / r.wall_s for r in runs)
                cpu = max(r.output_tokens / r.cpu_s for r in runs)
                checked = [cfg.warm[key], *runs]
                same = sum(a == b for r in checked for a, b in zip(r.token_ids, reference))
                total = len(reference) * len(checked)
                drafted = sum(r.draft_tokens for r in runs)
                accepted = sum(r.accepted for r in runs)
                drafts = sum(r.drafts for r in runs)
                compiles = sum(r.compilations for r in runs)
                if compiles:
                    notes.append(f"{name} {w.name} b={batch} {cfg.label}: {compiles} "
                                 "compilations in the timed runs")
                rows.append([
                    name, w.name, batch, cfg.label, wall, wall / off_wall, cpu / off_cpu,
                    "—" if cfg.spec is None else (accepted / drafted if drafted else "no drafts"),
                    "—" if cfg.spec is None else (1 + accepted / drafts if drafts else "n/a"),
                    runs[0].steps,
                    "(reference)" if cfg is configs[0] else
                    "yes" if same == total else f"NO ({same}/{total} requests)"])
    for cfg in configs:
        cfg.engine = None  # free the engines before the next model's
    return rows, notes


def goal_lines(rows: list[list[Any]]) -> list[str]:
    """The goal rows, each met or not; ngram-always's beside them for reference (the engine
    does not ship without its switch)."""
    out = []
    for row in rows:
        model, workload, batch, label, _, wall, cpu = row[:7]
        if not isinstance(wall, float):
            continue
        if workload == "repetition" and batch == 1 and label.startswith("ngram"):
            goal, line = GOAL_SPEEDUP, f"- {model}, repetition, batch 1"
        elif workload == "mixed" and batch == 8 and not label.startswith("off"):
            goal, line = GOAL_SLOWDOWN, f"- {model}, mixed, batch 8"
        else:
            continue
        name = label.split(" ")[0]
        met = ("no switch: for reference" if name == "ngram-always"
               else f"goal >= {goal:g}x: " + ("met" if wall >= goal else "NOT met"))
        out.append(f"{line}, {name}: {wall:.2f}x wall, {cpu:.2f}x CPU ({met})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dummy,stories",
                   help="dummy (dummy-30m) and/or stories (stories260k)")
    p.add_argument("--batches", default="1,8", help="requests submitted together")
    p.add_argument("--proposers", default=None,
                   help="of off,off-sync,ngram,ngram-always,layer_skip,draft_model (default: "
                        "all but off-sync; off always runs; off-sync: off without async "
                        "scheduling; "
                        "ngram-always: drafting never switched off)")
    p.add_argument("--ngram-lookup", default="1-4",
                   help="ngram's prompt_lookup_min-prompt_lookup_max (default 1-4)")
    p.add_argument("--ngram-k", type=int, default=NGRAM["num_speculative_tokens"],
                   help="ngram's num_speculative_tokens (default %(default)s)")
    p.add_argument("--layer-skip-layers", type=int, default=None,
                   help="layer_skip's num_layers (default: half the model's layers)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens of a repetition request, the most of a mixed one "
                        "(default 128; --quick: 24)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of every engine; the best counts (default 2; --quick: 1)")
    p.add_argument("--waves", type=int, default=None,
                   help="groups of `batch` requests in a timed run (default 2; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench_spec_decode",
                   help="results/<output>.md (default: bench_spec_decode)")
    args = p.parse_args()
    size = SIZES[args.quick]
    for k in ("max_tokens", "repeats", "waves"):
        if getattr(args, k) is None:
            setattr(args, k, size[k])
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.proposers is not None:
        args.proposers = set(args.proposers.split(","))

    rows, notes = [], []
    for model in args.models.split(","):
        stories_bin = None
        if model in ("dummy", "dummy-30m"):
            name, hf_dir = "dummy-30m", dummy_hf_checkpoint()
        elif model in ("stories", "stories260k"):
            stories_bin = find_stories()
            if stories_bin is None:
                print("stories260K not found: skipped")
                continue
            name, hf_dir = "stories260k", stories_hf_checkpoint(stories_bin)
        else:
            raise ValueError(f"--models: unknown model {model!r} (dummy, stories)")
        r, n = bench_model(name, hf_dir, stories_bin, args, size)
        rows += r
        notes += n
        # The model's engines are gone; their executables stay in the jits' caches (shared by
        # engines of one process) unless dropped: four precompiled engines a model fill memory.
        gc.collect()
        jax.clear_caches()

    mixed_prompt = size["mixed_prompt"]
    body = (
        f"Goals: >= {GOAL_SPEEDUP:g}x output tok/s at batch 1 on the repetition workload with "
        f"ngram; no more than {100 * (1 - GOAL_SLOWDOWN):.0f}% slower (ratio >= "
        f"{GOAL_SLOWDOWN:g}) on the mixed workload at batch 8.\n\n"
        "Speculation off against each proposer, one engine each in one process, same weights; "
        f"greedy, EOS ignored. Batch b: b requests submitted together, {args.waves} such "
        f"group(s) one after the other per timed run. Repetition: {args.max_tokens} output "
        "tokens a request; for stories260k the prompt is a greedy story, BOS and the story's "
        f"first {size['cut']}+ tokens again (the continuation retells it); for dummy-30m "
        f"(random weights) a {size['prefix']}-token random prefix and a {size['span']}-token "
        f"random span three times. Mixed: prompts uniform in {mixed_prompt[0]}-"
        f"{mixed_prompt[1]} tokens, outputs in {max(1, args.max_tokens // 4)}-"
        f"{args.max_tokens}. Each engine warms up on the very workload, then "
        f"{args.repeats} timed run(s), engines alternating; the best counts. Ratios are to "
        "'off' on the same rows: wall = output tok/s, CPU = output tokens per CPU second of "
        "this process (steadier on a shared machine). Acceptance rate = accepted / drafted "
        "tokens; mean acceptance length = tokens a drafting request-step yields (1 + accepted "
        "drafts). Steps: engine steps of one timed run. Same greedy tokens: every request of "
        "the warm-up and timed runs equals the off run's. Every engine schedules with async "
        "scheduling, drafting steps included (the next step runs ahead as if every draft is "
        "accepted; every proposer drafts on the device, from the tokens really accepted); "
        "by default the engine measures its tokens/s drafting and not and keeps "
        "the faster ('ngram-always' never switches drafting off); 'off' is the engine as it "
        "ships"
        + (" and 'off-sync' is off without it" if "off-sync" in (args.proposers or ()) else "")
        + ". draft_model drafts with the target itself (a second copy of its weights and KV "
        "cache): greedy, every draft is accepted, so its row is the ceiling of what a draft "
        "buys against the full cost of a draft forward over every token, not a realistic "
        "pairing (no smaller model of these vocabularies is at hand). No prefix caching.\n\n"
        + markdown_table(["model", "workload", "batch", "proposer", "output tok/s (wall)",
                          "ratio to off (wall)", "ratio to off (CPU)", "acceptance rate",
                          "mean acceptance length", "steps", "same greedy tokens"], rows))
    goals = goal_lines(rows)
    if goals:
        body += "\n\nAgainst the goals:\n\n" + "\n".join(goals)
    if notes:
        body += "\n\nNotes:\n\n" + "\n".join(f"- {line}" for line in notes)
    write_result(args.output, "Speculative decoding", body)


if __name__ == "__main__":
    main()
