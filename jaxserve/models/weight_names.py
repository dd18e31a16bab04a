"""How a family's params are named in a checkpoint format: our param name -> the checkpoint's
tensor name. Our params stack the layers on axis 0 and multiply `x @ w`; checkpoints store one
tensor per layer (its name holds `{layer}`), the linear ones as torch's `[out, in]`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class WeightNames:
    tensors: dict[str, str]  # param -> tensor name, "{layer}" in per-layer ones
    transposed: frozenset[str]  # params stored `[out, in]`: ours is the transpose
    # Tensors some checkpoints carry that nothing reads (e.g. RoPE tables we recompute)
    ignored_suffixes: tuple[str, ...] = ()

    def per_layer(self, param: str) -> bool:
        return "{layer}" in self.tensors[param]

    def name(self, param: str, layer: int | None = None) -> str:
        return self.tensors[param].format(layer=layer)

    def names(self, param: str, num_layers: int) -> list[str]:
        """Every tensor holding `param`: one per layer, or the one."""
        if self.per_layer(param):
            return [self.name(param, layer) for layer in range(num_layers)]
        return [self.name(param)]

    def checkpoint_tensors(self, params: dict[str, np.ndarray],
                           num_layers: int) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's (name, tensor) pairs holding `params` (e.g. to write one)."""
        for param, value in params.items():
            values = value if self.per_layer(param) else [value]
            for name, w in zip(self.names(param, num_layers), values, strict=True):
                yield name, np.ascontiguousarray(w.T if param in self.transposed else w)
