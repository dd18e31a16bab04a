"""Every YAML under configs/ is valid: engine presets load with EngineConfig.from_yaml (and the
accelerator ones pass the Pallas kernels' start-up checks for a Llama-3-8B-class model), batch
specs load with load_spec, sweep specs with the sweep's loader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from jaxserve.config import EngineConfig
from jaxserve.entrypoints.batch_spec import load_spec, read_rows
from jaxserve.layers.attention import get_attention_backend, validate_backend

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PRESETS = sorted((CONFIGS / "engine").glob("*.yaml"))
RUN_SPECS = sorted((CONFIGS / "runs").glob("*.yaml"))
SWEEPS = sorted((CONFIGS / "sweeps").glob("*.yaml"))
# Llama-3-8B: 32 q heads, 8 KV heads, head_dim 128.
LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def test_there_are_presets_for_every_target():
    names = {p.stem for p in PRESETS}
    for prefix in ("cpu-stories260k", "cpu-dummy-30m", "tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-tpu7x",
                   "h100", "h200"):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_engine_preset_validates(path):
    config = EngineConfig.from_yaml(path)
    r, s = config.runner, config.scheduler
    for buckets, limit in ((r.token_buckets, s.max_num_batched_tokens),
                           (r.request_buckets, s.max_num_seqs)):
        if buckets is not None:
            assert buckets == sorted(buckets) and buckets[-1] >= limit


@pytest.mark.parametrize("path", [p for p in PRESETS if p.stem.startswith(("tpu", "h1", "h2"))],
                         ids=lambda p: p.stem)
def test_accelerator_preset_fits_the_pallas_kernel(path):
    config = EngineConfig.from_yaml(path)
    platform = "tpu" if path.stem.startswith("tpu") else "gpu"
    tp = config.parallel.tensor_parallel_size
    backend = get_attention_backend("pallas", platform)
    validate_backend(backend, platform=platform,
                     num_q_heads=LLAMA3_8B["num_q_heads"] // tp,
                     num_kv_heads=LLAMA3_8B["num_kv_heads"] // tp,
                     head_dim=LLAMA3_8B["head_dim"], block_size=config.cache.block_size,
                     max_num_seqs=config.scheduler.max_num_seqs,
                     pages_per_seq=-(-config.model.max_model_len // config.cache.block_size),
                     max_num_tokens=config.scheduler.max_num_batched_tokens, dtype="bfloat16")


def test_an_unknown_preset_key_is_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(yaml.safe_load(PRESETS[0].read_text()) | {"blok_size": 16}))
    with pytest.raises(ValueError, match="blok_size"):
        EngineConfig.from_yaml(bad)


@pytest.mark.parametrize("path", RUN_SPECS, ids=lambda p: p.stem)
def test_batch_run_spec_and_its_input_load(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # specs name paths from the repository root
    spec = load_spec(path)
    EngineConfig.from_kwargs(**spec.engine)
    rows, errors = read_rows(spec.input, spec.sampling)
    assert rows and not errors and len({r.key for r in rows}) == len(rows)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_spec_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import sweep

    spec = sweep.load_sweep(path)
    for point in sweep.grid_points(spec["grid"]):
        EngineConfig.from_kwargs(**sweep.point_engine_args(spec["engine"], point))


def test_dummy_model_config_is_the_30m_llama():
    from jaxserve.models.hf_loader import read_hf_config
    from jaxserve.models.llama_config import param_shapes

    cfg = read_hf_config(CONFIGS / "models" / "dummy-30m")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == (512, 8, 8, 4, 8192)
    params = sum(math.prod(s) for s in param_shapes(cfg).values())
    assert 25e6 < params < 35e6
