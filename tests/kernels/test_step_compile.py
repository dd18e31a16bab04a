"""The engine's real step at Llama-3-8B width, compiled deviceless by the target's own compiler
(`jaxserve compile-check`): libtpu in .venv-tpu, the CUDA compile-only plugin in .venv-gpu (both
made by scripts/setup_compile_venvs.sh). Every TPU/GPU preset compiles for its own target at its
own settings, with the KV pool sized into the memory the engine plans into, no copy of the KV
cache, and temporaries under 5% of HBM; a write that copies the cache fails the gate. Its
modelled time never beats its floor, and the decode batch of 128 requests is within 1.25x of
it where the model says so (results/bench_compile_check.md has every batch).

v5e runs all 32 layers; the other targets 4 layers, which is enough to catch per-layer copies.
Only the smallest and the largest buckets compile here (each 32-layer compile takes ~30 s on
CI's 2 cores); `scripts/bench_compile_check.py` compiles every bucket of every preset."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from full_run import params_with_full_run
from target_compilers import target_compiler_env

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "gpu_targets"
LLAMA3_8B = REPO / "configs" / "models" / "llama-3-8b"
VENVS = {"tpu": REPO / ".venv-tpu" / "bin" / "python", "gpu": REPO / ".venv-gpu" / "bin" / "python"}
# preset -> (target, layers)
PRESETS = {
    "tpu-v5e-llama3-8b": ("v5e:2x2", 32),
    "tpu-v6e-llama3-8b": ("v6e:2x2", 4),
    "tpu-v5p-llama3-8b": ("v5p:2x2x1", 4),
    "tpu-tpu7x-llama3-8b": ("tpu7x:2x2x1", 4),
    "h100-llama3-8b": (str(SHARED / "h100_sxm.txtpb"), 4),
    "h200-llama3-8b": (str(SHARED / "h200.txtpb"), 4),
}
# The other TPU generations compile the same program for another chip (~1 min each on CI):
# `pytest -m full` runs them.
FULL_RUN_PRESETS = ("tpu-v6e-llama3-8b", "tpu-v5p-llama3-8b", "tpu-tpu7x-llama3-8b")


def compile_check(platform: str, tmp_path: Path, *args: str,
                  model: Path = LLAMA3_8B) -> tuple[int, dict, str]:
    python = VENVS[platform]
    if not python.exists():
        pytest.skip(f"{python.parent.parent.name} absent: run "
                    f"scripts/setup_compile_venvs.sh {platform}")
    out = tmp_path / "report.json"
    env = target_compiler_env(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([str(python), "-m", "jaxserve.entrypoints.cli.main", "compile-check",
                           str(model), "--json", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stdout + proc.stderr[-4000:]


# Presets whose 128-request decode batch is modelled within 1.25x of its floor (v6e is not: its
# tensor-parallel all-reduces take ~26% of a decode step's floor there).
DECODE_WITHIN_GATE = ("tpu-v5e-llama3-8b", "h100-llama3-8b", "h200-llama3-8b")


def gates_but_the_floor(report: dict) -> list[str]:
    """The check's failures other than its cost gate: compiling, copies, memory."""
    return [f for f in report["failures"] if "floor" not in f]


def _preset_buckets(preset: Path) -> str:
    """The bucket holding the decode batch of 128 requests, and the largest."""
    import yaml

    cfg = yaml.safe_load(preset.read_text())
    tokens, reqs = cfg["token_buckets"], cfg["request_buckets"]
    decode = min(t for t in tokens if t >= 128)
    return f"{decode}:{min(reqs[0], decode)},{tokens[-1]}:{min(reqs[-1], tokens[-1])}"


@pytest.mark.slow
@pytest.mark.parametrize("name", params_with_full_run(PRESETS, FULL_RUN_PRESETS))
def test_preset_compiles_for_its_target_without_copying_the_cache(name, tmp_path):
    target, layers = PRESETS[name]
    platform = "tpu" if name.startswith("tpu") else "gpu"
    if platform == "gpu" and not Path(target).exists():
        pytest.skip(f"{target} absent (shared/gpu_targets)")
    preset = REPO / "configs" / "engine" / f"{name}.yaml"
    rc, report, log = compile_check(platform, tmp_path, "--target", target, "--config",
                                    str(preset), "--num-layers", str(layers), "--buckets",
                                    _preset_buckets(preset))
    assert report and not gates_but_the_floor(report), log
    assert report["num_layers"] == layers
    # Unrolled layers' weights share dims with activations: only stacks (TPU) are checked.
    weight_copies = 0 if platform == "tpu" and name != "tpu-tpu7x-llama3-8b" else None
    for bucket in report["buckets"]:
        assert bucket["compiled"] and bucket["cache_copies"] == 0, log
        assert bucket["weight_copies"] == weight_copies, log
        assert bucket["temp_bytes"] < 0.05 * report["hbm_bytes"], log
        assert bucket["total_bytes"] <= min(report["allocator_bytes"], report["planned_bytes"])
        assert all(cost["ratio"] >= 1.0 for cost in bucket["costs"]), log
    decode = [c for b in report["buckets"] for c in b["costs"]
              if c["label"].startswith("decode 128 ")]
    assert len(decode) == 1, log
    assert (decode[0]["ratio"] <= 1.25) == (name in DECODE_WITHIN_GATE), log
    if name == "tpu-v5e-llama3-8b":  # the bar: 4,096 blocks of 64 tokens per chip
        assert report["block_size"] == 64 and report["num_blocks"] >= 4096, log


# Mixture presets -> (target, model), at 4 of their layers: Qwen3-30B-A3B's grouped matmuls
# run the Hopper kernel on H200 (XLA:GPU's ragged dot, a dense matmul per expert, was 4.7x the
# decode floor) and XLA's ragged dot under expert parallelism on v6e; Mixtral under EP on v5p.
MOE_PRESETS = {
    "h200-qwen3-30b-a3b": (str(SHARED / "h200.txtpb"), "qwen3-30b-a3b"),
    "tpu-v6e-qwen3-30b-a3b": ("v6e:2x2", "qwen3-30b-a3b"),
    "tpu-v5p-mixtral-8x7b": ("v5p:2x2x1", "mixtral-8x7b"),
}


def compiled_decode(name: str, target: str, model: str, num_layers: int, buckets: str,
                    tmp_path: Path) -> tuple[int, dict, dict, str]:
    """Preset `name`'s step for `model` at `num_layers`, compiled in one bucket holding the
    decode batch of 128: asserted compiled with no cache or weight copy and temporaries under
    5% of HBM; (return code, report, the decode's cost, log)."""
    platform = "tpu" if name.startswith("tpu") else "gpu"
    if platform == "gpu" and not Path(target).exists():
        pytest.skip(f"{target} absent (shared/gpu_targets)")
    rc, report, log = compile_check(
        platform, tmp_path, "--target", target, "--config",
        str(REPO / "configs" / "engine" / f"{name}.yaml"), "--num-layers", str(num_layers),
        "--buckets", buckets, model=REPO / "configs" / "models" / model)
    assert report and report["num_layers"] == num_layers, log
    (bucket,) = report["buckets"]
    assert bucket["compiled"] and bucket["cache_copies"] == 0, log
    assert bucket["weight_copies"] == (0 if platform == "tpu" else None), log
    assert bucket["temp_bytes"] < 0.05 * report["hbm_bytes"], log
    (decode,) = bucket["costs"]
    assert decode["label"].startswith("decode 128 "), log
    return rc, report, decode, log


@pytest.mark.slow
@pytest.mark.parametrize("name", params_with_full_run(MOE_PRESETS, ("tpu-v5p-mixtral-8x7b",)))
def test_a_mixture_decodes_within_1_5x_of_its_floor_without_copies(name, tmp_path):
    """Issue 49's bar: the decode batch of 128 requests reads each touched expert once."""
    target, model = MOE_PRESETS[name]
    _, report, decode, log = compiled_decode(name, target, model, 4, "128:128", tmp_path)
    assert not gates_but_the_floor(report) and 1.0 <= decode["ratio"] <= 1.5, log


# Both under -m full: the v6e compile alone took 5.5 min of CI's 30 (the scan's period and
# remainder are checked against HF's logits on CPU in tests/models/test_gemma.py).
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("tpu-v6e-gemma3-27b", marks=pytest.mark.full),
                                  pytest.param("h200-gemma3-27b", marks=pytest.mark.full)])
def test_gemma3_local_and_global_layers_compile_without_copies(name, tmp_path):
    """Gemma-3-27B at 8 layers: the scan's one period of five local layers and a global one,
    then two local layers past it; decode at 128 requests within 1.25x of its floor."""
    target = "v6e:2x2" if name.startswith("tpu") else str(SHARED / "h200.txtpb")
    rc, _, decode, log = compiled_decode(name, target, "gemma-3-27b", 8, "128:256", tmp_path)
    assert rc == 0 and 1.0 <= decode["ratio"] <= 1.25, log


def draft_config_dir(tmp_path: Path) -> Path:
    """A draft model for Llama-3-8B as a config.json alone (the check reads no weights): the
    same vocabulary, half the width (16 heads of 128), 2 layers. (A head_dim of 64 gets its
    cache relaid out around the kernels on TPU, as the target or as a draft alike.)"""
    config = json.loads((LLAMA3_8B / "config.json").read_text()) | {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
        "num_attention_heads": 16}
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    return tmp_path / "draft"


@pytest.mark.slow
@pytest.mark.parametrize("name, method", [
    pytest.param("tpu-v6e-llama3-8b", "layer_skip", marks=pytest.mark.full),
    pytest.param("h200-llama3-8b", "layer_skip", marks=pytest.mark.full),
    ("tpu-v6e-llama3-8b", "draft_model")])
def test_speculative_steps_compile_without_copying_the_cache(name, method, tmp_path):
    """Layer skip's drafting program (a loop of partial-depth decodes writing the cache, then
    the verifying pass) and the wider sample-row variant keep the cache in place too; so do
    a draft model's (its catch-up pass in both, its decode loop writing its own cache)."""
    target, _ = PRESETS[name]
    platform = "tpu" if name.startswith("tpu") else "gpu"
    if platform == "gpu" and not Path(target).exists():
        pytest.skip(f"{target} absent (shared/gpu_targets)")
    preset = REPO / "configs" / "engine" / f"{name}.yaml"
    # TPU: a fixed pool (64-token blocks) spares sizing it by compiling the preset's largest
    # step (a 4096-token drafting program, a minute on CI); a small pool of H200's 16-token
    # blocks would make weight-sized copies count as cache copies, so it is sized there.
    pool = ["--num-kv-blocks", "2048"] if platform == "tpu" else []
    spec = {"method": method, "num_speculative_tokens": 3} | (
        {"num_layers": 2} if method == "layer_skip" else {"model": str(draft_config_dir(tmp_path))})
    rc, report, log = compile_check(
        platform, tmp_path, "--target", target, "--config", str(preset), "--num-layers", "4",
        "--buckets", "64:16", *pool, "--speculative-config", json.dumps(spec))
    assert report and not gates_but_the_floor(report), log
    assert report["draft_num_layers"] == (2 if method == "draft_model" else 0), log
    plain, drafting = report["buckets"]  # the bucket's two programs
    assert (plain["num_sample_rows"], plain["device_drafts"]) == (16, False), log
    assert (drafting["num_sample_rows"], drafting["device_drafts"]) == (64, True), log
    for bucket in report["buckets"]:
        assert bucket["compiled"] and bucket["cache_copies"] == 0, log
        assert bucket["weight_copies"] == (0 if platform == "tpu" else None), log


@pytest.mark.slow
def test_a_write_that_copies_the_cache_fails_the_gate(tmp_path):
    layers = 2
    rc, report, log = compile_check(
        "tpu", tmp_path, "--target", "v5e:2x2", "--config",
        str(REPO / "configs" / "engine" / "tpu-v5e-llama3-8b.yaml"), "--num-layers",
        str(layers), "--buckets", "256:64", "--num-kv-blocks", "2048", "--kv-write", "scatter")
    assert rc == 1, log
    (bucket,) = report["buckets"]
    assert bucket["compiled"] and bucket["cache_copies"] >= 2 * layers, log  # K and V per layer
    assert any("copies of the KV cache" in f for f in report["failures"]), log


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tpu-v5e-llama3-8b",
                                  pytest.param("h200-llama3-8b", marks=pytest.mark.full)])
def test_a_preset_builds_its_compiled_dir_deviceless(name, tmp_path):
    """`jaxserve compile --target`: every program of the preset, serialized. Here with 4 layers,
    the smallest token bucket and 16 requests: each bucket adds its step and eight sampling
    programs, whose TPU compile grows with their rows (~9 s each at 256 rows on CI's cores)."""
    import yaml

    target, _ = PRESETS[name]
    platform = "tpu" if name.startswith("tpu") else "gpu"
    if not VENVS[platform].exists() or (platform == "gpu" and not Path(target).exists()):
        pytest.skip(f"{platform} compile venv or target description absent")
    preset = REPO / "configs" / "engine" / f"{name}.yaml"
    bucket = str(yaml.safe_load(preset.read_text())["token_buckets"][0])
    out = tmp_path / "compiled"
    env = target_compiler_env(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([str(VENVS[platform]), "-m", "jaxserve.entrypoints.cli.main", "compile",
                           str(LLAMA3_8B), "--target", target, "--config", str(preset),
                           "--num-layers", "4", "--token-buckets", bucket,
                           "--max-num-batched-tokens", bucket, "--max-num-seqs", "16",
                           "--request-buckets", "16",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    kinds = [p["kind"] for p in manifest["programs"]]
    assert kinds.count("step") == 1  # one token bucket, one request bucket
    assert "kv_init" in kinds and kinds.count("sample") >= 4
    fp = manifest["fingerprint"]
    assert fp["platform"] == platform and fp["model"]["num_layers"] == 4
    assert all((out / p["file"]).stat().st_size == p["bytes"] for p in manifest["programs"])
