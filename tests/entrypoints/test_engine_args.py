"""Engine arguments: one type check (config.check_engine_args) behind `EngineConfig.from_kwargs`,
`LLM(...)`, batch specs and the CLI; errors name the argument."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest

from jaxserve.config import (ENGINE_ARGS, EngineConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, check_engine_args)
from jaxserve.config.disaggregation import DisaggregationConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.entrypoints.cli.args import add_engine_args, engine_kwargs


@pytest.mark.parametrize("name, value", [
    ("max_num_seqs", "8"),
    ("max_num_seqs", 8.0),
    ("max_num_seqs", True),  # a bool is not an integer here
    ("max_num_seqs", None),  # not optional
    ("enable_prefix_caching", "yes"),
    ("gpu_memory_utilization", "0.5"),
    ("dtype", 32),
    ("token_buckets", [16, "32"]),
    ("token_buckets", 16),
    ("max_model_len", 1.5),
    ("max_num_partial_prefills", "1"),
])
def test_from_kwargs_rejects_a_wrong_type_naming_the_argument(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be "):
        EngineConfig.from_kwargs(**{name: value})


def test_from_kwargs_rejects_an_unknown_key_and_suggests_the_near_one() -> None:
    with pytest.raises(ValueError, match="max_num_seq: unknown engine argument.*'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=8)
    with pytest.raises(ValueError, match="^zzz: unknown engine argument$"):
        EngineConfig.from_kwargs(zzz=1)


def test_from_kwargs_accepts_right_types_optional_nulls_and_paths(tmp_path: Path) -> None:
    config = EngineConfig.from_kwargs(
        model=tmp_path, max_num_seqs=8, gpu_memory_utilization=1, max_model_len=None,
        token_buckets=[16, 32], enable_prefix_caching=False, max_num_partial_prefills=2)
    assert config.model.model == str(tmp_path)  # a Path is stored as its string
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_num_partial_prefills == 2
    assert config.cache.gpu_memory_utilization == 1 and config.model.max_model_len is None
    assert config.runner.token_buckets == [16, 32] and config.cache.enable_prefix_caching is False


def test_llm_rejects_a_string_for_an_integer_before_loading_anything() -> None:
    from jaxserve import LLM

    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs="8")


def test_the_where_prefix_names_the_argument_in_its_document() -> None:
    with pytest.raises(ValueError, match=r"^engine\.max_num_seqs must be int, got 'four'"):
        check_engine_args({"max_num_seqs": "four"}, "engine")
    with pytest.raises(ValueError, match=r"^grid\.blok_size: unknown engine argument"):
        check_engine_args({"blok_size": 16}, "grid")
    check_engine_args({"max_num_seqs": 4, "disaggregation": "split.yaml"}, "engine")


@pytest.mark.parametrize("value", [-1, 1.5])
def test_max_num_partial_prefills_must_be_a_non_negative_integer(value: Any) -> None:
    config = EngineConfig.from_kwargs()
    config.scheduler.max_num_partial_prefills = value  # past from_kwargs: validate still checks
    with pytest.raises(ValueError, match="max_num_partial_prefills must be an integer >= 0"):
        config.validate()


@pytest.mark.parametrize("name, value", [
    ("cpu_kv_cache_space_gib", -1.0), ("cpu_kv_cache_space_gib", 0),
    ("cpu_kv_cache_space_gib", float("nan")), ("cpu_kv_cache_space_gib", float("inf")),
    ("distributed_timeout_s", -5), ("distributed_timeout_s", 0),
])
def test_sizes_and_timeouts_must_be_positive(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be .*got {value!r}"):
        EngineConfig.from_kwargs(**{name: value})


def test_positive_sizes_and_timeouts_are_accepted() -> None:
    config = EngineConfig.from_kwargs(cpu_kv_cache_space_gib=0.5, distributed_timeout_s=1)
    assert (config.cache.cpu_kv_cache_space_gib, config.parallel.distributed_timeout_s) == (0.5, 1)


def test_cli_flag_for_max_num_partial_prefills_reaches_the_scheduler_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-num-partial-prefills", "2",
                              "--long-prefill-token-threshold", "64"])
    kwargs = engine_kwargs(args)
    assert kwargs == {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 64}
    config = EngineConfig.from_kwargs(**kwargs)
    assert config.scheduler.max_num_partial_prefills == 2
    assert EngineConfig.from_kwargs().scheduler.max_num_partial_prefills == 0  # default: off
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-partial-prefills", "two"])


def test_every_engine_argument_round_trips_through_the_type_check() -> None:
    kwargs = EngineConfig.from_kwargs().to_kwargs()
    assert set(kwargs) == set(ENGINE_ARGS)
    check_engine_args(kwargs)  # the defaults themselves pass
    assert EngineConfig.from_kwargs(**kwargs).to_kwargs() == kwargs


@pytest.mark.parametrize("config", [
    EngineConfig(model=ModelConfig(seed=None, hf_overrides='{"rope_theta": 20000.0}'),
                 parallel=ParallelConfig(disaggregation={"prefill": {"max_num_seqs": 4},
                                                         "decode": {"num_devices": 2}})),
    EngineConfig(model=ModelConfig(seed=None, hf_overrides={"rope_theta": 20000.0}),
                 scheduler=SchedulerConfig(
                     speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')),
], ids=["disaggregation", "speculative"])
def test_validate_leaves_the_config_as_it_was_and_normalized_parses_a_copy(
        config: EngineConfig) -> None:
    before = copy.deepcopy(config)
    config.validate()
    assert config == before
    normal = config.normalized()
    assert config == before
    assert normal.model.model is not None and isinstance(normal.model.seed, int)
    assert normal.model.hf_overrides == {"rope_theta": 20000.0}
    if config.parallel.disaggregation is not None:
        assert isinstance(normal.parallel.disaggregation, DisaggregationConfig)
    else:
        assert isinstance(normal.scheduler.speculative_config, SpeculativeConfig)
    assert EngineConfig.from_kwargs(**normal.to_kwargs()) == normal


def test_download_dir_finds_a_hub_id_in_a_local_hub_cache_and_fetches_nothing(hf_checkpoint,
                                                                             tmp_path):
    """vLLM's --download-dir: models--ORG--NAME/snapshots/REV (refs/main names REV)."""
    import shutil

    from jaxserve.config import EngineConfig

    repo = tmp_path / "cache" / "models--tiny-org--tiny-llama"
    shutil.copytree(hf_checkpoint("llama"), repo / "snapshots" / "abc123")
    (repo / "snapshots" / "old999").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    cfg = EngineConfig.from_kwargs(model="tiny-org/tiny-llama",
                                   download_dir=str(tmp_path / "cache"))
    assert cfg.model.model == str(repo / "snapshots" / "abc123")
    (repo / "refs" / "main").unlink()  # two revisions and no ref: which one is ambiguous
    with pytest.raises(ValueError, match=r"model: .*holds 2 revisions and no refs/main"):
        EngineConfig.from_kwargs(model="tiny-org/tiny-llama", download_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"model: 'other/model' is not a local path, nor in "
                                         r"download_dir .*jaxserve fetches nothing"):
        EngineConfig.from_kwargs(model="other/model", download_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"download_dir: .* is not a directory"):
        EngineConfig.from_kwargs(model="other/model", download_dir=str(tmp_path / "none"))
