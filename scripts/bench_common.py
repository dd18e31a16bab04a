"""Shared pieces of the benchmark scripts: seeded workloads, timed engine runs, the models
(dummy ~30M Llama saved as an HF checkpoint, stories260K converted to HF), markdown results."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "results"
DUMMY_CONFIG_DIR = REPO_ROOT / "configs" / "models" / "dummy-30m"
STORIES_CANDIDATES = (Path("/work/shared/models/stories260K"),
                      REPO_ROOT.parent / "shared" / "models" / "stories260K")
CACHE_DIR = Path(os.environ.get("JAXSERVE_BENCH_CACHE", Path.home() / ".cache" / "jaxserve"
                                / "bench"))


# ---- workloads ----------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, num_requests: int, prompt_len: tuple[int, int],
                  output_len: tuple[int, int], vocab_size: int, seed: int = 0,
                  shared_prefix: float = 0.0) -> Workload:
    """Random token prompts (ids >= 3: no BOS/EOS/pad), lengths uniform in the closed ranges.
    `shared_prefix`: that fraction of every prompt is one common prefix."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt_len[0], prompt_len[1] + 1, num_requests)
    prefix = rng.integers(3, vocab_size, int(max(lens) * shared_prefix)).tolist()
    prompts = []
    for n in lens:
        k = int(n * shared_prefix)
        prompts.append(prefix[:k] + rng.integers(3, vocab_size, int(n) - k).tolist())
    outs = rng.integers(output_len[0], output_len[1] + 1, num_requests).tolist()
    return Workload(name, prompts, [int(o) for o in outs])


# ---- timed engine runs --------------------------------------------------------------------
@dataclass
class RunResult:
    elapsed_s: float
    cpu_s: float  # CPU time of this process (all its threads): steadier than wall time when
    # other processes share the machine
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    e2e_s: list[float]
    prefix_hit_rate: float
    num_preemptions: int
    num_steps: int
    num_compilations: int
    outputs: list[Any] = field(repr=False, default_factory=list)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def run_engine(engine: Any, workload: Workload, arrival_s: list[float] | None = None,
               prefix: str = "w") -> RunResult:
    """Greedy, EOS ignored, every request to its output length. All requests arrive at once,
    or at `arrival_s` (seconds after the start; added between steps once due)."""
    from jaxserve import SamplingParams

    before = engine.stats()
    arrivals = arrival_s or [0.0] * len(workload.prompts)
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    pending = list(order)
    finished: list[Any] = []
    start, start_wall, start_cpu = time.perf_counter(), time.time(), time.process_time()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            # Arrival is when it was due, not when the step loop got to it: TTFT includes that.
            engine.add_request(f"{prefix}{i}", {"prompt_token_ids": workload.prompts[i]},
                               SamplingParams(temperature=0.0, max_tokens=workload.output_lens[i],
                                              ignore_eos=True),
                               arrival_time=start_wall + arrivals[i])
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[pending[0]] - now, 0.01)))
            continue
        finished.extend(o for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    cpu_s = time.process_time() - start_cpu
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    itl: list[float] = []
    for o in finished:
        itl.extend(np.diff(o.metrics.token_times).tolist())
    return RunResult(
        elapsed_s=elapsed, cpu_s=cpu_s, prompt_tokens=sum(len(p) for p in workload.prompts),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in finished),
        ttft_s=[o.metrics.time_to_first_token for o in finished], itl_s=itl,
        e2e_s=[o.metrics.finished_time - o.metrics.arrival_time for o in finished],
        prefix_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        num_steps=after.num_steps - before.num_steps,
        num_compilations=after.num_compilations - before.num_compilations, outputs=finished)


def pct_ms(values_s: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values_s) * 1e3, q)) if values_s else float("nan")


def make_engine(model: str | Path, **engine_args: Any) -> Any:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=str(model), **engine_args))


def fastest_torch_threads(probe: Callable[[], Any]) -> int:
    """Set torch to whichever thread count, 1 or 2, runs `probe` (a short piece of the HF side
    of a benchmark) faster, and return it: on a busy 2-core machine, 2 OpenMP threads can be
    5-10x slower than 1."""
    import torch

    best, best_s = 1, float("inf")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.no_grad():
            start = time.perf_counter()
            probe()
            seconds = time.perf_counter() - start
        if seconds < best_s:
            best, best_s = threads, seconds
    torch.set_num_threads(best)
    return best


# ---- models -------------------------------------------------------------------------------
def find_stories() -> Path | None:
    for folder in STORIES_CANDIDATES:
        if (folder / "stories260K.bin").is_file():
            return folder / "stories260K.bin"
    return None


def dummy_hf_checkpoint(out_dir: Path | None = None, seed: int = 0,
                        name: str = "dummy-30m") -> Path:
    """configs/models/`name` (dummy-30m, or dummy-moe: 8 experts, top 2, ~115M) with random
    weights (transformers' own init), saved once with `save_pretrained` so that HF and
    jaxserve load the very same weights."""
    out_dir = out_dir or CACHE_DIR / f"{name}-hf-s{seed}"
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(DUMMY_CONFIG_DIR.parent / name))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    return out_dir


def canonical_to_hf(params: dict[str, np.ndarray], num_layers: int,
                    tie: bool) -> dict[str, np.ndarray]:
    """jaxserve's canonical weights (`x @ w`, layers stacked; embedding and LM head [vocab, hidden])
    as HF Llama tensors ([out, in])."""
    hf = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not tie:
        hf["lm_head.weight"] = params["lm_head"]
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = params["attn_norm"][i]
        hf[p + "post_attention_layernorm.weight"] = params["mlp_norm"][i]
        for name, hf_name in names.items():
            hf[p + hf_name + ".weight"] = params[name][i].T
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf.items()}


def stories_hf_checkpoint(stories_bin: Path, out_dir: Path | None = None) -> Path:
    """stories260K as an HF Llama directory, written from jaxserve's canonical params (q/k rows
    already in HF's half-split RoPE order)."""
    out_dir = out_dir or CACHE_DIR / "stories260K-hf"
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    from safetensors.numpy import save_file

    from jaxserve.models.loader import load_model

    loaded = load_model(stories_bin, "llama2c")
    c = loaded.config
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(canonical_to_hf(loaded.params, c.num_layers, c.tie_word_embeddings),
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32"}, indent=2))
    return out_dir


# ---- results ------------------------------------------------------------------------------
def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "n/a" if np.isnan(v) else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs; 0 where unknown). A step whose bytes fit in it can
    run faster than the DRAM bound: its weights stay in the cache from one step to the next."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        size = (index / "size").read_text().strip()
        sizes.append(int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return max(sizes)


def cpu_model() -> str:
    """The CPU's model name (Linux), else the architecture: results from two machines of the
    same architecture differ by far more than noise (caches, memory, vector units)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def machine_line() -> str:
    import jax

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    cache = last_level_cache_bytes()
    return (f"{cpu_model()}" + (f" ({cache / 2**20:.0f} MiB cache)" if cache else "")
            + f", {os.cpu_count()} CPUs, "
            f"jax {jax.__version__} ({jax.default_backend()}), load average "
            f"{load[0]:.1f} at the end")


def write_result(name: str, title: str, body: str) -> Path:
    """results/<name>.md: title, the command that made it, the machine, then `body`."""
    RESULTS_DIR.mkdir(exist_ok=True)
    command = "python scripts/" + Path(sys.argv[0]).name + "".join(
        f" {a}" for a in sys.argv[1:])
    text = (f"### {title}\n\n`{command}` — {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{machine_line()}\n\n{body.strip()}\n")
    path = RESULTS_DIR / f"{name}.md"
    path.write_text(text)
    print(text)
    return path


# ---- per-step timing, as the engine records it ------------------------------------------
def timed_steps_ms(engine: Any, steps: int) -> dict[str, float]:
    """Run `steps` engine steps; ms per step of each phase the engine times itself
    (`EngineStats.step_seconds`, see jaxserve/core/step_timing.py: the difference of two
    readings), and of the whole `LLMEngine.step` as "step"."""
    before = engine.stats().step_seconds
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    after = engine.stats().step_seconds
    ms = {phase: 1e3 * (after[phase] - before[phase]) / steps for phase in after}
    ms["step"] = 1e3 * elapsed / steps
    return ms


def device_only_ms(engine: Any, repeats: int = 5) -> float:
    """The last step's programs re-run on their device inputs (ModelRunner.time_last_step)."""
    return 1e3 * engine.core.executor.worker.runner.time_last_step(repeats)


def fill_decoding(engine: Any, num_requests: int, prompt_len: int, vocab: int,
                  max_tokens: int = 10_000, seed: int = 0, prefix: str = "d") -> list[str]:
    """Add requests and step until every one is past its prefill (all are decoding). Raises
    if any was preempted or finished meanwhile: the batch would not be the one asked for (the
    KV cache must hold every prompt plus the tokens the first ones decode while the last ones
    prefill)."""
    from jaxserve import SamplingParams

    rng = np.random.default_rng(seed)
    ids = [f"{prefix}{i}" for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(3, vocab, prompt_len).tolist()},
                           params)
    sched = engine.core.scheduler
    preemptions = sched.num_preemptions
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
        if sched.num_preemptions != preemptions or not set(ids) <= sched.requests.keys():
            raise RuntimeError(f"fill_decoding: {num_requests} requests of {prompt_len} tokens "
                               "do not fit the KV cache together (preempted or finished)")
    return ids
