"""The device mesh's axis names: placement/mesh.py builds every mesh with them, the sharding
rules and the layers' per-device kernels shard over the model (tensor-parallel) axis."""

from __future__ import annotations

DATA_AXIS = "data"
AXIS = "model"  # tensor parallelism: heads, vocabulary, MLP columns
