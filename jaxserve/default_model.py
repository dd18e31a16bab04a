"""The model that ships inside the package: a tiny Llama trained on Python's docstrings.

`scripts/train_tiny_model.py` made it; its card (`README.md` beside the weights) says how.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "assets" / "default_model"


def default_model_path() -> str:
    """The shipped HF checkpoint directory; a ValueError if the install lacks it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"default model: no config.json in {DEFAULT_MODEL_DIR}; the package "
                         "was installed without its data files (jaxserve/assets/default_model)")
    return str(DEFAULT_MODEL_DIR)
