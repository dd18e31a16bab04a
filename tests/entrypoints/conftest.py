"""Batch-runner fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from batch_helpers import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def engine_args(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Small buckets: few compiled shapes."""
    return dict(model=str(tiny_model), load_format="dummy", max_model_len=128, num_kv_blocks=64,
                block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                token_buckets=[16, 64], request_buckets=[4],
                compilation_cache_dir=str(tmp_path_factory.mktemp("xla_cache")))
