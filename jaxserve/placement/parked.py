"""Device arrays taken off their devices and put back as they were (sleep mode), and host values
written over device arrays (a weight update). Each array comes back with its shape, dtype and
sharding, so the programs compiled for the old arrays take the new ones: nothing compiles.

Trees are handled as their leaves by path (the keys from the root to each leaf), which is how
a model names the arrays of its state dict (`Llama.held_parts`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

LeafPath = tuple[Any, ...]  # dict keys from a tree's root to one of its leaves


def leaves_by_path(tree: Any) -> tuple[dict[LeafPath, Any], jax.tree_util.PyTreeDef]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(key.key for key in path): leaf for path, leaf in leaves}, treedef


def tree_of(treedef: jax.tree_util.PyTreeDef, leaves: dict[LeafPath, Any]) -> Any:
    """The tree of `leaves_by_path`'s leaves (in its order)."""
    return jax.tree.unflatten(treedef, list(leaves.values()))


def device_bytes(arrays: Any) -> int:
    """Bytes the devices hold for a tree of arrays (a replicated array once per device)."""
    return sum(shard.data.nbytes for array in jax.tree.leaves(arrays)
               if not array.is_deleted() for shard in array.addressable_shards)


@dataclass(slots=True)
class Parked:
    """A tree of device arrays taken off the devices."""
    treedef: jax.tree_util.PyTreeDef
    specs: dict[LeafPath, jax.ShapeDtypeStruct]  # each array's shape, dtype and sharding
    host: dict[LeafPath, np.ndarray]  # the copies kept (an array dropped has none)


def park(tree: Any, keep: Callable[[LeafPath], bool]) -> Parked:
    """Take a tree's arrays off their devices (deleted there, once no computation reads them),
    keeping host copies of those `keep` says."""
    leaves, treedef = leaves_by_path(tree)
    jax.block_until_ready(list(leaves.values()))
    # np.array copies: a CPU array's host view would die with its device buffer.
    parked = Parked(treedef, {path: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                              for path, a in leaves.items()},
                    {path: np.array(a) for path, a in leaves.items() if keep(path)})
    for array in leaves.values():
        array.delete()
    return parked


def unpark(parked: Parked, dropped: dict[LeafPath, np.ndarray]) -> Any:
    """The parked tree on its devices again, the arrays dropped given by `dropped`."""
    host = parked.host | dropped
    return tree_of(parked.treedef, {path: jax.device_put(host[path], spec.sharding)
                                    for path, spec in parked.specs.items()})


def written(old: jax.Array | jax.ShapeDtypeStruct,
            parts: list[tuple[tuple[int, ...], np.ndarray]]) -> np.ndarray:
    """A host array of `old`'s shape and dtype with each part (an index into it, the value
    there) written over it; where the parts leave some of it, those values are `old`'s, read
    back from its devices."""
    depth = len(parts[0][0])
    covered = len({index for index, _ in parts}) == math.prod(old.shape[:depth])
    out = np.empty(old.shape, old.dtype) if covered else np.array(old)
    for index, value in parts:
        out[index] = value
    return out
