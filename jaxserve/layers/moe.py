"""A sparse mixture-of-experts MLP: each token's router picks its top-k experts, and every
expert runs its gated MLP on the tokens routed to it only.

The (token, expert) pairs are sorted by expert so each expert's rows are contiguous, and the
three projections are grouped matmuls over those groups (`jax.lax.ragged_dot`): one op per
projection however many experts, no Python loop over experts, no expert computing rows it was
not routed. Shapes stay static: T * k rows, whatever the routing.

Scanned layers hand the experts over as the whole stack [L, E, ...]: its layers' experts are
the groups of one grouped matmul, of which only this layer's get rows. A slice of the stack
would be copied out every layer (the grouped matmul is a custom call on TPU, which takes its
operands whole), where the stack itself is a free reshape.

XLA runs a ragged dot as a dense matmul of every row with every expert on GPU and CPU; only
TPU's walks the groups with rows. So each device picks its grouped matmul (`kernel_for`): on
Hopper (sm_90) JAX's Mosaic GPU kernel, which walks (row tile, expert) pairs with rows, for
unrolled layers (GPU's default: its groups are unrolled in its code, so it takes one layer's
experts, not a stack); on the CPU a loop over the same pairs, one small matmul each.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.kernels.traffic import KernelTraffic, RaggedBatch, name_params, tiled_name
from jaxserve.layers.axes import AXIS

# The scope of the grouped matmuls, named with the experts a layer has on this device and in
# all (`moe_experts_e32_n128`): the cost model reads it off the compiled calls (`hbm_traffic`).
EXPERTS_SCOPE = "moe_experts"
# The Hopper kernel's tiles (rows, output columns, contraction); its lhs and rhs share a 16-bit
# dtype, the contraction divides by block_k and the output by block_n. 128-row tiles: each
# (row tile, expert) pair reads the expert once, so fewer tiles read less (Qwen3-30B-A3B on
# H200, modelled: decode 128 1.19x -> 1.15x of the floor, T=4096 mixed 3.55x -> 2.77x, 4
# layers, against 64-row tiles); decode stays bound by the weights' reads either way.
HOPPER_TILES = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4,
                "grid_block_n": 1}
GROUPED_MATMULS = ("ragged_dot", "hopper", "row_tiles")


def kernel_for(device: Any) -> str:
    """The grouped matmul `device` (a real one or a compile target's) runs best."""
    if device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0":
        return "hopper"
    return "row_tiles" if device.platform == "cpu" else "ragged_dot"


def _fits_hopper_kernel(w_gate: jax.Array) -> bool:
    d, f = w_gate.shape[-2:]
    return (w_gate.ndim == 3 and w_gate.dtype in (jnp.bfloat16, jnp.float16)
            and all(n % math.lcm(HOPPER_TILES["block_k"], HOPPER_TILES["block_n"]) == 0
                    for n in (d, f)))


def route(x: jax.Array,  # [T, D], normed
          router: jax.Array,  # [D, E]
          top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's experts i32[T, k] and their weights f32[T, k]: the softmax over all the
    experts' logits (in float32), its top k, renormalised to sum to 1 where `normalize`."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def moe_mlp(x: jax.Array,  # [T, D], normed
            router: jax.Array,  # [D, E]
            w_gate: jax.Array,  # [E_local, D, F], or the stack [L, E_local, D, F]
            w_up: jax.Array,  # as w_gate
            w_down: jax.Array,  # [E_local, F, D], or the stack [L, E_local, F, D]
            top_k: int, normalize: bool, layer: int | jax.Array = 0,
            first_expert: int | jax.Array = 0, kernel: str = "ragged_dot",
            ) -> jax.Array:  # [T, D]
    """The experts' outputs for every token, of the experts [first_expert, + E_local) held
    here (all of them by default): a token's pairs routed elsewhere add nothing. `layer`
    picks the layer's experts out of a stack. `kernel`: one of GROUPED_MATMULS (`kernel_for`
    the device); the Hopper kernel where one layer's experts fit its tiles, else XLA's."""
    if kernel not in GROUPED_MATMULS:
        raise ValueError(f"grouped matmul must be one of {GROUPED_MATMULS}, got {kernel!r}")
    T = x.shape[0]
    if kernel == "hopper" and not _fits_hopper_kernel(w_gate):
        kernel = "ragged_dot"
    if w_gate.ndim == 4:  # the stack: every layer's experts are groups, this layer's get rows
        num_local = w_gate.shape[1]
        w_gate, w_up, w_down = (w.reshape(-1, *w.shape[2:]) for w in (w_gate, w_up, w_down))
        offset = layer * num_local
    else:
        num_local, offset = w_gate.shape[0], 0
    groups = w_gate.shape[0]
    experts, weights = route(x, router, top_k, normalize)
    local = experts.reshape(-1) - first_expert  # i32[T * k], pair p is token p // k
    group = jnp.where((local >= 0) & (local < num_local), offset + local, groups)
    order = jnp.argsort(group, stable=True)  # the pairs grouped by expert, others last
    rows = x[order // top_k]  # [T * k, D]
    # rows past the groups' sizes are left out of the matmuls: they come out zero
    sizes = jnp.bincount(group, length=groups + 1)[:groups].astype(jnp.int32)
    matmul = functools.partial(_grouped_matmul, sizes=sizes, kernel=kernel, touched=num_local)
    tiles = {"m": HOPPER_TILES["block_m"]} if kernel == "hopper" else {}
    with jax.named_scope(tiled_name(EXPERTS_SCOPE, e=num_local, n=router.shape[1], **tiles)):
        y = matmul(jax.nn.silu(matmul(rows, w_gate)) * matmul(rows, w_up), w_down)  # [T * k, D]
    if kernel == "hopper":  # the kernel leaves rows past the groups unwritten
        y = jnp.where((jnp.arange(y.shape[0]) < sizes.sum())[:, None], y, 0)
    # Each pair back in token order, weighted; a token's k outputs summed.
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def _grouped_matmul(rows: jax.Array,  # [M, K], grouped: the first sizes[0] rows group 0's
                    w: jax.Array,  # [G, K, N]
                    sizes: jax.Array,  # i32[G]
                    kernel: str, touched: int) -> jax.Array:  # [M, N]; rows past the groups 0
    """`touched`: at most this many groups have rows."""
    if kernel == "hopper":
        return _hopper_grouped_matmul(rows, w, sizes)
    if kernel == "row_tiles":
        return _row_tiled_matmul(rows, w, sizes, touched)
    return jax.lax.ragged_dot(rows, w, sizes)


def _row_tiled_matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array,
                      touched: int) -> jax.Array:
    """A loop over (row tile, group) pairs with rows: each tile's rows times its group's
    weights. A group of s rows takes ceil(s / C) tiles, so at most touched + M // C in all.
    On an AVX2 EPYC at 8 experts of 512 x 1024, 3-6x faster than XLA:CPU's ragged dot from 16
    to 2048 rows (16-row tiles up to 256 rows, 64-row tiles past that)."""
    M = rows.shape[0]
    C = 16 if M <= 256 else 64
    ends = jnp.cumsum(sizes)  # i32[G]
    num_tiles = (sizes + C - 1) // C  # i32[G]
    last_tile = jnp.cumsum(num_tiles)  # i32[G]: one past each group's last tile
    tile = jnp.arange(touched + M // C)
    group = jnp.minimum(jnp.searchsorted(last_tile, tile, side="right"), w.shape[0] - 1)
    start = ends[group] - sizes[group] + (tile - last_tile[group] + num_tiles[group]) * C
    padded = jnp.pad(rows, ((0, C), (0, 0)))  # the last tile's slice stays in bounds

    def one_tile(i: jax.Array, out: jax.Array) -> jax.Array:
        y = jax.lax.dynamic_slice_in_dim(padded, start[i], C) @ w[group[i]]  # [C, N]
        mine = (start[i] + jnp.arange(C) < ends[group[i]])[:, None]
        old = jax.lax.dynamic_slice_in_dim(out, start[i], C)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), start[i], 0)

    out = jnp.zeros((M + C, w.shape[2]), jnp.result_type(rows, w))
    return jax.lax.fori_loop(0, last_tile[-1], one_tile, out)[:M]


@jax.jit  # one program for every layer's call of one shape: the kernel is lowered once
def _hopper_grouped_matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    # imported here: Mosaic GPU's modules add ~0.4 s to every start elsewhere
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    short = HOPPER_TILES["block_m"] - rows.shape[0]  # its row tile must fit in the array
    padded = jnp.pad(rows, ((0, max(short, 0)), (0, 0)))
    return ragged_dot_mgpu.ragged_dot(padded, w, group_sizes=sizes,
                                      **HOPPER_TILES)[:rows.shape[0]]


def expert_parallel_moe(x: jax.Array,  # [T, D], normed, on every device
                        router: jax.Array,  # [D, E], on every device
                        w_gate: jax.Array,  # [(L,) E, D, F], experts split over the model axis
                        w_up: jax.Array,  # as w_gate
                        w_down: jax.Array,  # [(L,) E, F, D], as w_gate
                        top_k: int, normalize: bool, layer: int | jax.Array,
                        mesh: Mesh, kernel: str = "ragged_dot") -> jax.Array:  # [T, D]
    """Expert parallelism: each device holds E / n whole experts and runs them on the rows
    routed to them; every device routes the tokens alike (tensor-parallel attention leaves
    them on every device) and the partial outputs are summed over the devices, the one
    all-reduce a tensor-parallel MLP ends in too."""
    def local(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array, layer: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(AXIS) * w_gate.shape[-3]
        return jax.lax.psum(moe_mlp(x, router, w_gate, w_up, w_down, top_k, normalize, layer,
                                    first, kernel), AXIS)

    experts = P(*(None,) * (w_gate.ndim - 3), AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), experts, experts, experts, P()),
                         out_specs=P(), check_vma=False)(
        x, router, w_gate, w_up, w_down, jnp.asarray(layer, jnp.int32))


def hbm_traffic(name: str, operands: list[tuple[tuple[int, ...], int]],
                batch: RaggedBatch) -> KernelTraffic:
    """What one grouped matmul (XLA's ragged dot, a Mosaic kernel on TPU, which walks the
    groups that have rows only) reads and runs: the weights of the `e` experts of the layer
    held here that its rows are routed to (at most one a row), each once, and the matmul of
    the rows routed here (of all n experts' pairs, those of these e on average). The Hopper
    kernel (`m`: its row tile) reads an expert's weights and runs a whole row tile for each
    (row tile, expert) pair with rows: at most one an expert plus one a tile. Its rows and
    output pass once, counted by the caller; its weights operand is the only one of rank 3
    [G, K, N]."""
    params = name_params(name, EXPERTS_SCOPE)
    j = next(j for j, (dims, _) in enumerate(operands) if len(dims) == 3)
    (_, k, n), itemsize = operands[j]
    rows = max(dims[0] for dims, _ in operands if len(dims) == 2)
    routed_here = rows * params["e"] / params["n"]
    touched = min(params["e"], rows)
    if "m" not in params:
        return KernelTraffic(manual_operands=(j,), weights=touched * k * n * itemsize,
                             flops=2.0 * routed_here * k * n)
    pairs = touched + math.ceil(routed_here / params["m"])
    return KernelTraffic(manual_operands=(j,), weights=pairs * k * n * itemsize,
                         flops=2.0 * pairs * params["m"] * k * n)
