"""Executables built ahead of time (`jaxserve compile`, on the host): an engine started from the
directory compiles nothing (counted by JAX itself, strict mode on) and gives the same tokens; a
directory built for another engine, or damaged, is refused with a message naming why."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine_helpers import COMPILE_EVENT, backend_compiles, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams
from jaxserve.compilation import aot
from jaxserve.config import EngineConfig
from jaxserve.programs.device_step import step_key
from jaxserve.programs.input_batch import StepArrays
from jaxserve.runtime import compiled_dir
from jaxserve.runtime.program_order import first_programs

ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=[8, 16, 32], request_buckets=[4],
              compilation_cache_dir="")
SPEC_ENGINE = ENGINE | {"token_buckets": [32]}  # 2 step programs: a draft doubles their cost
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def built(hf_checkpoint, tmp_path_factory):
    path = hf_checkpoint("llama")
    out = tmp_path_factory.mktemp("compiled")
    aot.build_on_host(EngineConfig.from_kwargs(model=str(path), **ENGINE), out)
    return path, out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


FRESH_PROCESS = """
import json, sys
import jax
events = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: events.append(event) if event == sys.argv[1] else None)
from jaxserve import LLM, SamplingParams
llm = LLM(sys.argv[2], compiled_dir=sys.argv[3], **json.loads(sys.argv[4]))
out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=8,
                   ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"compiles": len(events), "tokens": list(out)}))
"""


@pytest.mark.parametrize("strict", [False, True])
def test_a_fresh_process_from_a_compiled_dir_compiles_nothing_strict_or_not(built, strict):
    """In a new process (nothing compiled in memory before): not the steps, the KV pool's
    zeros, nor anything placing the weights."""
    path, out = built
    args = ENGINE | {"strict_compile": strict, "precompile": strict}
    run = subprocess.run([sys.executable, "-c", FRESH_PROCESS, COMPILE_EVENT, str(path),
                          str(out), json.dumps(args)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"compiles": 0, "tokens": hf_greedy(path, [[5, 6, 7]], 8)[0]}


def test_an_engine_from_a_compiled_dir_compiles_nothing_and_gives_the_same_tokens(built):
    path, out = built
    with backend_compiles() as events:
        llm = LLM(str(path), compiled_dir=str(out), precompile=True, strict_compile=True,
                  **ENGINE)
        prompts = random_prompts(5, 1, 30, seed=71)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        sampled = llm.generate({"prompt_token_ids": prompts[0]},
                               SamplingParams(temperature=0.8, seed=3, max_tokens=4, logprobs=2),
                               use_tqdm=False)[0]
    assert events == [] and llm.stats().num_compilations == 0  # the KV pool's zeros too
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(path, prompts, 8)
    assert len(sampled.outputs[0].logprobs) == 4


def test_a_start_loads_a_prefill_and_the_decode_program_in_the_background(built, monkeypatch):
    """A start from a directory deserialises the KV pool's program, one prefill bucket's step,
    the one-token decode step's and their samplers' on a background thread. A prompt whose own
    bucket is not loaded yet runs padded in the loaded prefill bucket, so no program loads in
    its way, and its own bucket's loads behind it. Tokens: HF's; nothing compiles."""
    path, out = built
    loads: list[tuple[str, object]] = []
    deserialize = compiled_dir.LoadedPrograms._deserialize

    def recorded(self: compiled_dir.LoadedPrograms, key: object) -> object:
        program = deserialize(self, key)
        loads.append((threading.current_thread().name, key))
        return program

    def wait_for(key: object) -> None:
        deadline = time.monotonic() + 120
        while ("jaxserve-programs", key) not in loads:
            assert time.monotonic() < deadline, f"background loads: {loads}"
            time.sleep(0.05)

    monkeypatch.setattr(compiled_dir.LoadedPrograms, "_deserialize", recorded)
    llm = LLM(str(path), compiled_dir=str(out), precompile=True, strict_compile=True,
              **ENGINE)
    runner = llm.engine.core.executor.worker.runner
    # buckets of 8, 16 and 32 tokens: a decode step takes the first, a 12-token prompt the
    # second, and the bucket nearest FIRST_PROMPT_TOKENS is the largest
    decode, middle, prefill = (step_key(StepArrays.empty(T, 4, runner.max_blocks_per_seq))
                               for T in (8, 16, 32))
    first = first_programs(runner.warm_up_programs())
    assert first[:3] == [compiled_dir.KV_INIT, prefill, decode]
    wait_for(first[-1])
    prompt = list(range(5, 17))
    want = hf_greedy(path, [prompt], 8)[0]
    got = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want
    assert [key for thread, key in loads if thread == "MainThread" and key[0] == "step"] == []
    wait_for(middle)
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want and llm.stats().num_compilations == 0


def run_speculative_from_dir(path: Path, spec: dict, prompts: list[list[int]], out: Path,
                             ) -> LLM:
    """Build a directory for an engine with `spec`, then run `prompts` from it in strict mode:
    nothing compiles and the greedy tokens are HF's."""
    aot.build_on_host(EngineConfig.from_kwargs(model=str(path), speculative_config=spec,
                                               **SPEC_ENGINE), out)
    with backend_compiles() as events:
        llm = LLM(str(path), compiled_dir=str(out), precompile=True, strict_compile=True,
                  speculative_config=spec, **SPEC_ENGINE)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert events == [] and llm.stats().num_compilations == 0
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(path, prompts, 8)
    return llm


def test_an_ngram_engines_dir_holds_its_token_cache_and_compiles_nothing(hf_checkpoint,
                                                                        tmp_path):
    """n-gram speculation's token cache is allocated by the directory's KV-pool program
    beside the KV caches, and its drafting program comes from there too."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "adaptive": False}
    prompts = [p * 3 for p in random_prompts(4, 3, 8, seed=73)]  # repeats: drafts get accepted
    llm = run_speculative_from_dir(hf_checkpoint("llama"), spec, prompts, tmp_path / "out")
    assert llm.stats().spec_decoding.num_draft_tokens > 0


def test_a_draft_models_dir_runs_it_compiling_nothing_and_refuses_another_draft(
        hf_checkpoint, tmp_path):
    """The draft model's catch-up and drafting programs and its KV pool come from the
    directory; the fingerprint holds the draft's architecture (the target drafting for itself
    here), so a directory built for another draft is refused."""
    path = hf_checkpoint("llama")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2,
            "adaptive": False}
    llm = run_speculative_from_dir(path, spec, random_prompts(5, 1, 30, seed=72),
                                   tmp_path / "out")
    stats = llm.stats().spec_decoding
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0, stats
    other = hf_checkpoint("llama", seed=5, num_layers=1, hidden_size=32, num_heads=2,
                          num_kv_heads=1)
    with pytest.raises(compiled_dir.CompiledDirError, match=r"draft_model\.hidden_size"):
        LLM(str(path), compiled_dir=str(tmp_path / "out"), strict_compile=True,
            speculative_config=spec | {"model": str(other)}, **SPEC_ENGINE)


def test_a_dir_built_for_other_buckets_is_refused_naming_the_field(built, tmp_path):
    path, out = built
    other = dict(ENGINE, token_buckets=[16, 32, 64], max_num_batched_tokens=64)
    with pytest.raises(compiled_dir.CompiledDirError, match="token_buckets"):
        LLM(str(path), compiled_dir=str(out), strict_compile=True, **other)
    llm = LLM(str(path), compiled_dir=str(out), **other)  # not strict: a warning, then compiles
    assert llm.generate({"prompt_token_ids": [3, 4, 5]}, GREEDY, use_tqdm=False)[0].outputs


@pytest.mark.parametrize("field,value,message", [
    (("versions", "jax"), "0.0.1", r"versions\.jax: built for '0.0.1'"),
    (("platform",), "tpu", r"platform: built for 'tpu', this engine has 'cpu'"),
    (("device_kind",), "TPU v5 lite", r"device_kind: built for 'TPU v5 lite'"),
])
def test_a_dir_built_by_another_jax_or_for_another_target_is_refused(built, tmp_path, field,
                                                                     value, message):
    path, out = built
    moved = _copy(out, tmp_path / "other")
    manifest = json.loads((moved / compiled_dir.MANIFEST).read_text())
    *outer, last = field
    entry = manifest["fingerprint"]
    for key in outer:
        entry = entry[key]
    entry[last] = value
    (moved / compiled_dir.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(compiled_dir.CompiledDirError, match=message):
        LLM(str(path), compiled_dir=str(moved), strict_compile=True, **ENGINE)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_program_file_is_refused_never_loaded(built, tmp_path, damage):
    path, out = built
    moved = _copy(out, tmp_path / damage)
    victim = sorted(moved.glob("*-step.bin"))[0]
    blob = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(blob[:len(blob) // 2])
    elif damage == "flip":
        victim.write_bytes(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    else:
        victim.unlink()
    with pytest.raises(compiled_dir.CompiledDirError, match=victim.name):
        LLM(str(path), compiled_dir=str(moved), strict_compile=True, **ENGINE)
