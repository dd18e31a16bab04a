"""On a lent TPU/GPU: the engine's device path serves the shipped model. A cold engine on the
default attention backend (the Pallas kernel on TPU and GPU) must give the greedy tokens of one on
the pure-JAX `xla` backend; then a compiled directory is built for this device (`jaxserve
compile`), an engine started from it in strict mode must compile nothing and give the cold
engine's tokens. The kernels' own check (numerics and bandwidth against the HBM peak) is
scripts/bench_attention.py; scripts/device_gpu_check.sh runs both on a lent GPU.

    python scripts/device_check.py [--target ../shared/gpu_targets/h200.txtpb]

With --target the directory is built deviceless for that description (as CI builds them), so
the check is that a deviceless build runs on the real chip. Prints PASS/FAIL lines; exit 1 on
a failure.

Run on CPU here (PASS); not yet on a TPU or GPU: no task so far has been lent one with this
script in place.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.default_model import default_model_path
from jaxserve.executor import aot
from jaxserve.executor.targets import resolve_target
from jaxserve.models.hf_loader import read_hf_config

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
              token_buckets=[128], request_buckets=[8], compilation_cache_dir="")
PROMPTS = ["def ", "Return the", "class ", "import "]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="build deviceless for this target first")
    args = p.parse_args()
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
    for what, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + what)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
