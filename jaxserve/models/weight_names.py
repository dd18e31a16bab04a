"""How a family's params are named in a checkpoint format: our param name -> the checkpoint's
tensor name. Our params stack the layers on axis 0 (and a mixture's experts on axis 1) and
multiply `x @ w`; checkpoints store one tensor per layer (its name holds `{layer}`) and expert
(`{expert}`), the linear ones as torch's `[out, in]`."""

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

    def per_expert(self, param: str) -> bool:
        return "{expert}" in self.tensors[param]

    def name(self, param: str, layer: int | None = None, expert: int | None = None) -> str:
        return self.tensors[param].format(layer=layer, expert=expert)

    def names(self, param: str, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
        """Every tensor holding `param` of `shape` (ours): its index into the param (layer,
        and expert) and its name."""
        if not self.per_layer(param):
            yield (), self.name(param)
            return
        for layer in range(shape[0]):
            if self.per_expert(param):
                for expert in range(shape[1]):
                    yield (layer, expert), self.name(param, layer, expert)
            else:
                yield (layer,), self.name(param, layer)

    def stored_shape(self, param: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each tensor holding `param` of `shape` (ours), as stored."""
        one = shape[self.per_layer(param) + self.per_expert(param):]
        return tuple(reversed(one)) if param in self.transposed else one

    def checkpoint_tensors(self, params: dict[str, np.ndarray],
                           ) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's (name, tensor) pairs holding `params` (e.g. to write one)."""
        for param, value in params.items():
            for index, name in self.names(param, value.shape):
                w = value[index]
                yield name, np.ascontiguousarray(w.T if param in self.transposed else w)
