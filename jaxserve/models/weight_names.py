"""How a family's params are named in a checkpoint format: our param name -> the checkpoint's
tensor name. Our params stack the layers on axis 0 (and a mixture's experts on axis 1) and
multiply `x @ w`; checkpoints store one tensor per layer (its name holds `{layer}`) and expert
(`{expert}`), the linear ones as torch's `[out, in]`. Some store several params in one tensor
(Phi-3's qkv_proj: the q, k and v rows one after the other); each is then a block of its rows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorPart:
    """What one checkpoint tensor holds of a param: `param[index]`, which is the whole tensor
    or, in a tensor fused with other params, its `rows`."""
    param: str
    index: tuple[int, ...]  # layer (and expert) of a per-layer param; () for a whole param
    name: str
    stored: tuple[int, ...]  # the whole tensor's shape, as stored
    rows: slice | None
    transposed: bool  # stored `[out, in]`

    def ours(self, w: np.ndarray) -> np.ndarray:
        """`param[index]` in our layout from the tensor as stored (its `rows`, when fused)."""
        return w.T if self.transposed else w


@dataclass(frozen=True, slots=True)
class WeightNames:
    tensors: dict[str, str]  # param -> tensor name, "{layer}" in per-layer ones
    transposed: frozenset[str]  # params stored `[out, in]`: ours is the transpose
    # Tensors some checkpoints carry that nothing reads (e.g. RoPE tables we recompute)
    ignored_suffixes: tuple[str, ...] = ()
    # Tensors holding several params (each param's `tensors` entry names the tensor) -> those
    # params in the order of their blocks of stored rows
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tensor, params in self.fused.items():
            for param in params:
                if self.tensors.get(param) != tensor:
                    raise ValueError(f"fused tensor {tensor!r}: param {param!r} is named "
                                     f"{self.tensors.get(param)!r}")

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
        """The shape of `param`'s part of each tensor holding it (ours: `shape`), as stored."""
        one = shape[self.per_layer(param) + self.per_expert(param):]
        return tuple(reversed(one)) if param in self.transposed else one

    def fused_rows(self, param: str, shapes: dict[str, tuple[int, ...]],
                   ) -> tuple[slice, tuple[int, ...]] | None:
        """Where `param` lies in a fused tensor: its rows there and the whole tensor's stored
        shape, from our `shapes` of the params fused with it; None when it has a tensor of its
        own."""
        params = self.fused.get(self.tensors[param], ())
        if param not in params:
            return None
        parts = [self.stored_shape(p, shapes[p]) for p in params]  # each [rows, in]
        i = params.index(param)
        start = sum(part[0] for part in parts[:i])
        return slice(start, start + parts[i][0]), (sum(part[0] for part in parts), *parts[i][1:])

    def parts(self, shapes: dict[str, tuple[int, ...]]) -> Iterator[TensorPart]:
        """Every tensor's part of every param of `shapes` (ours), param by param."""
        for param, shape in shapes.items():
            fused = self.fused_rows(param, shapes)
            rows, stored = fused if fused else (None, self.stored_shape(param, shape))
            for index, name in self.names(param, shape):
                yield TensorPart(param, index, name, stored, rows, param in self.transposed)

    def unread(self, name: str, tied: bool) -> bool:
        """Whether tensor `name`, which no param reads, may be in a checkpoint: a table we
        recompute, or the LM head of a model whose embedding is `tied` to it."""
        return name.endswith(self.ignored_suffixes) or (tied and name == self.name("lm_head"))

    def checkpoint_tensors(self, params: dict[str, np.ndarray],
                           ) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's (name, tensor) pairs holding `params` (e.g. to write one)."""
        in_fused = {p for fused in self.fused.values() for p in fused}
        for param, value in params.items():
            if param not in in_fused:
                for index, name in self.names(param, value.shape):
                    yield name, self._stored(param, value[index])
        for fused in self.fused.values():
            values = [params[p] for p in fused]
            for index, name in self.names(fused[0], values[0].shape):
                yield name, np.concatenate([self._stored(p, v[index])
                                            for p, v in zip(fused, values)])

    def _stored(self, param: str, w: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w.T if param in self.transposed else w)
