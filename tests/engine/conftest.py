"""Engine test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One persistent XLA cache for the session: engines with equal shapes reuse compilations."""
    return str(tmp_path_factory.mktemp("xla_cache"))
