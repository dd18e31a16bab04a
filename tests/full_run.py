"""Parameter lists with some values left to the full run (`pytest -m full`, see pyproject)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def params_with_full_run(names: Iterable[str], full_run: Iterable[str]) -> list:
    """`names` as pytest parameters, those in `full_run` marked `full`."""
    full_run = set(full_run)
    return [pytest.param(name, marks=pytest.mark.full) if name in full_run else name
            for name in names]
