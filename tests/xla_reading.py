"""An independent reading of a compiled program's bytes: XLA's own HloCostAnalysis (through
jaxlib, on the host's CPU client) of the program's text, with each loop body counted as many
times as the loop runs. XLA counts a body once; run on a body alone (the body made the module's
entry), it counts that body's ops once more each time the reading asks."""

from __future__ import annotations

import re

import jax
from jax._src.lib import _jax
from jaxlib import _hlo


def xla_bytes(text: str, entry: str | None = None) -> float:
    """XLA's own `bytes accessed` of a module, or of one of its computations as the entry."""
    lines = text.splitlines()
    if entry is not None:  # the body as the module's entry, the old entry a plain computation
        lines[0] = re.sub(r", (entry_computation_layout|input_output_alias)=\{.*?\}(?=, [a-z_]+=|$)",
                          "", lines[0])
        lines = [ln.removeprefix("ENTRY ") for ln in lines]
        lines = ["ENTRY " + ln if ln.startswith(f"%{entry} ") else ln for ln in lines]
    module = _hlo.hlo_module_from_text("\n".join(lines))
    return _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)["bytes accessed"]


def xla_reading(text: str, trips: dict[str, int]) -> float:
    """XLA's count with each top-level loop's body counted `trips[body]` times, not once."""
    total = xla_bytes(text)
    for body, trips_ in trips.items():
        total += (trips_ - 1) * xla_bytes(text, body)
    return total
