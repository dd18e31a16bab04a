"""The compile check's cost model on the target compilers' own programs (Llama-3-8B width,
4 layers, deviceless: libtpu in .venv-tpu, the CUDA compile-only plugin in .venv-gpu):
- its bytes of the TPU step, outside the Pallas kernels and in every memory space, agree with
  XLA's own count of the same compiled HLO with the layer loop's body times its trip count
  (tests/xla_reading.py), within 10%;
- a model that counts the loop body once, as XLA's own figure does, lands under the step's
  floor, and the gate refuses it;
- a prefill kernel with tiny query tiles, which reads a chunk's KV prefix again for every tile,
  fails the gate, where the default tiles pass it; the TPU kernel reads a chunk's prefix once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from jaxserve.compilation import hlo_text
from jaxserve.compilation.compile_report import BucketReport, CompileReport, ScenarioCost
from jaxserve.compilation.hlo_text import ITEMSIZE
from jaxserve.compilation.step_cost import step_cost, trip_count
from jaxserve.compilation.step_floor import bucket_scenarios
from jaxserve.kernels.tpu.ragged_paged_attention import KERNEL as TPU_ATTENTION
from jaxserve.kernels.tpu.ragged_paged_attention import hbm_traffic as tpu_attention_traffic
from jaxserve.kernels.traffic import RaggedBatch
from jaxserve.placement.targets import CHIPS
from target_compilers import target_compiler_env
from xla_reading import xla_reading

REPO = Path(__file__).resolve().parents[2]
LLAMA3_8B = REPO / "configs" / "models" / "llama-3-8b"
H100 = REPO.parent / "shared" / "gpu_targets" / "h100_sxm.txtpb"
LAYERS = 4


def compile_check(platform: str, out: Path, *args: str) -> tuple[int, dict, str]:
    python = REPO / f".venv-{platform}" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python.parent.parent.name} absent: run "
                    f"scripts/setup_compile_venvs.sh {platform}")
    env = target_compiler_env(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([str(python), "-m", "jaxserve.entrypoints.cli.main", "compile-check",
                           str(LLAMA3_8B), "--num-layers", str(LAYERS), "--json",
                           str(out / "report.json"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else {}
    return proc.returncode, report, proc.stdout + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def v5e_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("v5e")
    _, report, log = compile_check(
        "tpu", out, "--target", "v5e:2x2", "--config",
        str(REPO / "configs" / "engine" / "tpu-v5e-llama3-8b.yaml"), "--buckets",
        "128:128,2048:256", "--dump-hlo", str(out / "hlo"))
    assert report and all(b["compiled"] for b in report["buckets"]), log
    return out / "hlo", report, log


@pytest.mark.slow
def test_device_memory_bytes_agree_with_xla_counting_each_layer(v5e_step):
    hlo_dir, report, log = v5e_step
    for path in sorted(hlo_dir.glob("*.hlo")):
        text = path.read_text()
        module = hlo_text.parse(text)
        (loop,) = [i for i in module.entry_computation.instructions if i.opcode == "while"]
        assert trip_count(module, loop, module.entry_computation) == LAYERS
        scenario = bucket_scenarios(128, 128, 8192, [128])[0]
        cost = step_cost(module, CHIPS["TPU v5 lite"], scenario.batch, 4, frozenset(range(8)))
        outside_kernels = cost.hbm_bytes - cost.in_kernels
        reading = xla_reading(text, {loop.called[1]: LAYERS})
        assert outside_kernels == pytest.approx(reading, rel=0.10), (path.name, log)


@pytest.mark.slow
def test_the_one_layer_count_falls_under_the_floor_and_fails_the_gate(v5e_step):
    """The old check's figure, XLA's bytes accessed (the layer loop's body once, no kernel),
    as a step time: under every batch's floor, which the gate says."""
    _, report, log = v5e_step
    chip = CHIPS["TPU v5 lite"]
    costs = []
    for bucket in report["buckets"]:
        for cost in bucket["costs"]:
            assert cost["ratio"] >= 1.0, log  # the model itself never beats the floor
            fields = {k: v for k, v in cost.items() if k not in ("modelled_seconds", "ratio")}
            costs.append(ScenarioCost(**fields | {
                "compute_seconds": bucket["bytes_accessed"] / chip.hbm_bandwidth,
                "collective_seconds": 0.0}))
    gated = CompileReport(**{k: v for k, v in report.items()
                             if k in CompileReport.__dataclass_fields__ and k != "buckets"})
    gated.buckets = [BucketReport(128, 128, 128, compiled=True, costs=costs)]
    failures = gated.failures()
    assert len(failures) == len(costs) and all("under its floor" in f for f in failures)


@pytest.mark.slow
@pytest.mark.skipif(not H100.exists(), reason=f"{H100} absent")
def test_a_tiny_tile_prefill_kernel_fails_the_gate_where_the_default_tiles_pass(tmp_path):
    args = ("--target", str(H100), "--config",
            str(REPO / "configs" / "engine" / "h100-llama3-8b.yaml"), "--buckets", "8192:256")
    rc, report, log = compile_check("gpu", tmp_path, *args)
    assert rc == 0 and not report["failures"], log
    default_read = report["buckets"][0]["costs"][0]["kv_read"]
    rc, report, log = compile_check("gpu", tmp_path, *args,
                                    "--attention-tiles", "num_queries_per_block=16")
    assert rc == 1, log
    (cost, *_) = report["buckets"][0]["costs"]
    assert cost["kv_read"] > 2.5 * default_read  # the chunk's prefix, once per 16-token tile
    assert any("x its floor" in f for f in report["failures"]), report["failures"]


@pytest.mark.slow
@pytest.mark.parametrize("start", [0, 6144])
def test_a_prefill_chunk_reads_its_prefix_once_in_the_compiled_step(v5e_step, start):
    """The kernel as the v5e program calls it (its name and operands in the compiled HLO), on
    the largest bucket's chunk alone: KV read at most 1.1x the chunk's prefix and itself."""
    hlo_dir, _, _ = v5e_step
    module = hlo_text.parse((hlo_dir / "T2048_R256_S256.hlo").read_text())
    body = module.computations[next(i for i in module.entry_computation.instructions
                                    if i.opcode == "while").called[1]]
    (call,) = [i for i in body.instructions if i.name.startswith(TPU_ATTENTION)]
    operands = [(body.by_name[o].array.dims, ITEMSIZE[body.by_name[o].array.dtype])
                for o in call.operands]
    chunk = 1793
    traffic = tpu_attention_traffic(call.name.split(".")[0], operands,
                                    RaggedBatch((chunk,), (start + chunk,)))
    (_, kv_heads, _, _, head_dim), itemsize = operands[8]
    once = 2 * kv_heads * (start + chunk) * head_dim * itemsize  # K and V
    assert once <= traffic.kv_read <= 1.1 * once
