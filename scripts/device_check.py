"""On a lent TPU/GPU: the engine's device path serves the shipped model. A cold engine on the
default attention backend (the Pallas kernel on TPU and GPU) must give the greedy tokens of one on
the pure-JAX `xla` backend; then a compiled directory is built for this device (`jaxserve
compile`), an engine started from it in strict mode must compile nothing and give the cold
engine's tokens. The kernels' own check (numerics and bandwidth against the HBM peak) is
scripts/bench_attention.py; scripts/device_gpu_check.sh runs both on a lent GPU.

    python scripts/device_check.py [--target ../shared/gpu_targets/h200.txtpb]
    python scripts/device_check.py --timing configs/engine/h100-llama3-8b.yaml [--out t.json]

With --target the directory is built deviceless for that description (as CI builds them), so
the check is that a deviceless build runs on the real chip. Prints PASS/FAIL lines; exit 1 on
a failure.

With --timing, the preset's engine over random weights of Llama-3-8B width times its real model
step on every batch the compile check judges each bucket on (step_floor.scenario_step), and
prints it beside the step's time as the cost model reads that same compiled program on this
chip, and the floor: the model is validated the day a chip is lent (`--layers N` for a
shallower model that fits a smaller device).

Run on CPU here (PASS; --timing runs, with no model for a CPU); not yet on a TPU or GPU: no
task so far has been lent one with this script in place.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.compilation import aot
from jaxserve.config import EngineConfig
from jaxserve.default_model import default_model_path
from jaxserve.models.hf_loader import read_hf_config
from jaxserve.placement.targets import resolve_target

LLAMA3_8B = Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3-8b"
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
              token_buckets=[128], request_buckets=[8], compilation_cache_dir="")
PROMPTS = ["def ", "Return the", "class ", "import "]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def time_buckets(preset: Path, layers: int | None, buckets: str | None, num_kv_blocks: int | None,
                 out: Path | None) -> int:
    """The real step's best time per judged batch beside the cost model's and the floor."""
    import yaml

    from jaxserve.compilation import hlo_text
    from jaxserve.compilation.compile_check import device_model_config
    from jaxserve.compilation.step_cost import step_cost
    from jaxserve.compilation.step_floor import bucket_scenarios, scenario_step, step_floor
    from jaxserve.placement.sharding import padded_vocab_size
    from jaxserve.placement.targets import chip_of

    model = Path(tempfile.mkdtemp()) / "llama-3-8b"  # the config alone: random weights
    model.mkdir()
    config_json = json.loads((LLAMA3_8B / "config.json").read_text())
    if layers:
        config_json["num_hidden_layers"] = layers
    (model / "config.json").write_text(json.dumps(config_json))
    kwargs = yaml.safe_load(preset.read_text()) | {
        "model": str(model), "load_format": "dummy", "precompile": False,
        "compilation_cache_dir": ""} | ({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {})
    llm = LLM(**kwargs)
    worker = llm.engine.core.executor.worker
    runner, config, plan = worker.runner, llm.engine.config, worker.plan
    tp = config.parallel.tensor_parallel_size
    cfg = device_model_config(worker.model.cfg, tp, False)  # the worker's: already as held
    chip = chip_of(jax.devices()[0].device_kind)
    weight_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(runner.params))
    rows = []
    pairs = ([tuple(int(n) for n in pair.split(":")) for pair in buckets.split(",")] if buckets
             else plan.bucket_pairs)
    for T, R in pairs:
        for scenario in bucket_scenarios(T, R, plan.max_model_len, plan.token_buckets):
            try:
                arrays = scenario_step(scenario.batch, T, R, plan.block_size,
                                       plan.blocks_per_seq, plan.num_kv_blocks)
            except ValueError as e:
                print(f"T {T}  R {R}  batch {scenario.label}  skipped: {e}", flush=True)
                continue
            measured, hlo = runner.time_step(arrays)
            row = {"T": T, "R": R, "batch": scenario.label, "measured_ms": measured * 1e3}
            if chip is not None:
                cost = step_cost(hlo_text.parse(hlo), chip, scenario.batch, tp)
                floor = step_floor(cfg, tp, weight_bytes, worker.model.dtype.itemsize,
                                   scenario.batch, padded_vocab_size(cfg.vocab_size, tp), chip)
                row |= {"modelled_ms": cost.seconds * 1e3, "floor_ms": floor.seconds * 1e3,
                        "sequential_floor_ms": floor.sequential_seconds * 1e3,
                        "measured_over_modelled": measured / cost.seconds}
            rows.append(row)
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items()), flush=True)
    if out is not None:
        out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "preset": str(preset),
                                   "rows": rows}, indent=2))
    return 0


def hopper_moe_matches() -> tuple[str, bool] | None:
    """On a Hopper GPU: a mixture layer's grouped matmuls in the Hopper kernel against XLA's
    ragged dot, bf16 experts at Qwen3-30B-A3B's widths (128 experts, top 8) over 64 tokens;
    None elsewhere."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.layers.moe import kernel_for, moe_mlp

    if kernel_for(jax.devices()[0]) != "hopper":
        return None
    rng = np.random.default_rng(0)
    E, D, F = 128, 2048, 768
    x, router = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((64, D), (D, E)))
    gate, up = (jnp.asarray(0.03 * rng.standard_normal((E, D, F)), jnp.bfloat16)
                for _ in range(2))
    down = jnp.asarray(0.03 * rng.standard_normal((E, F, D)), jnp.bfloat16)
    run = jax.jit(moe_mlp, static_argnums=(5, 6, 9))  # one layer's experts: the kernel's case
    kernel, xla = (np.asarray(run(x, router, gate, up, down, 8, True, 0, 0, k), np.float32)
                   for k in ("hopper", "ragged_dot"))
    error = float(np.abs(kernel - xla).max() / np.abs(xla).max())
    return f"Hopper grouped matmul against XLA's ragged dot: max error {error:.1e} of the " \
           f"largest output (bf16; bound 2e-2)", error < 2e-2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="build deviceless for this target first")
    p.add_argument("--timing", type=Path, default=None, metavar="PRESET",
                   help="time the preset's real step per judged batch beside the cost model")
    p.add_argument("--layers", type=int, default=None, help="with --timing: model depth")
    p.add_argument("--buckets", default=None, metavar="T:R,...",
                   help="with --timing: only these buckets (default: the preset's)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="with --timing: the KV pool (default: the preset's, or sized)")
    p.add_argument("--out", type=Path, default=None, help="with --timing: write JSON here")
    args = p.parse_args()
    if args.timing is not None:
        return time_buckets(args.timing, args.layers, args.buckets, args.num_kv_blocks, args.out)
    model = default_model_path()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    cold = LLM(model, precompile=True, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    xla = LLM(model, attention_backend="xla", **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    with tempfile.TemporaryDirectory() as out:
        config = EngineConfig.from_kwargs(model=model, **ENGINE)
        _, n = (aot.build_on_host(config, out) if args.target is None else aot.build_for_target(
            resolve_target(args.target), read_hf_config(Path(model)), config, out))
        compiles: list[str] = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, secs, **kw: compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration" else None)
        llm = LLM(model, compiled_dir=out, precompile=True, strict_compile=True, **ENGINE)
        warm = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cold, warm)]
    as_xla = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cold, xla)]
    checks = {f"default backend gives the xla backend's greedy tokens: {sum(as_xla)}/{len(as_xla)}":
              all(as_xla),
              f"{n} programs loaded, compilations after loading: {len(compiles)}": not compiles,
              f"same greedy tokens as a cold engine: {sum(same)}/{len(same)}": all(same)}
    if (moe := hopper_moe_matches()) is not None:
        checks[moe[0]] = moe[1]
    for what, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + what)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
