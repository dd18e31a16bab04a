"""Drafts proposed on the device, inside the step (its drafting program: steps without drafts
run the plain one), before the target's pass: `num_drafts` greedy decode iterations over the
step's drafting requests, each through a drafting model, taking the argmax. The drafts become
the step's inputs after each request's last token, for the target to verify.

The drafting model is one of:
- layer skip: the target's own first `num_layers` layers, the final norm and the LM head.
  Those layers' KV is the target's own (same weights, tokens, positions), so the drafts write
  it straight into the target's cache at the draft slots the scheduler allocated; the
  verifying pass then rewrites those slots. No second cache, no second prefill.
- a draft model (executor/draft_model.py): a smaller checkpoint with its own cache over the
  same blocks, kept complete by the catch-up pass every step runs after the target's.

Iteration 0 decodes each request's last known token (writing its KV at its position), and
iteration j the draft j before it, at the slots the scheduler allocated for the drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.sampler import argmax
from jaxserve.models.llama import Llama


def propose_drafts(model: Llama, num_layers: int | None, backend: AttentionBackend,
                   max_drafts: int, input_ids: jax.Array, md: AttentionMetadata,
                   draft_starts: jax.Array, num_drafts: jax.Array, k_cache: jax.Array,
                   v_cache: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Draft with `model` (its first `num_layers` layers; None: all) over its own caches.
    input_ids i32[T]: the step's inputs (drafts as placeholders); draft_starts i32[R]: each
    request's last known token (its row in the step), num_drafts i32[R]: its drafts (0: none).
    Returns (input_ids with the drafts in place, drafts i32[R, max_drafts], k_cache, v_cache)."""
    num_rows = draft_starts.shape[0]
    start = jnp.maximum(draft_starts, 0)
    rows = jnp.arange(num_rows + 1, dtype=jnp.int32)

    def draft(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        token, drafts, k_cache, v_cache = carry
        active = j < num_drafts                                       # bool[R]
        # Rows without a draft j write the null block's slot 0 and read one slot: padding.
        positions = jnp.where(active, md.positions[start + j], 0)
        step_md = AttentionMetadata(
            positions=positions, slot_mapping=jnp.where(active, md.slot_mapping[start + j], 0),
            query_start_loc=rows, seq_lens=positions + 1, block_tables=md.block_tables)
        hidden, k_cache, v_cache = model(token, step_md, k_cache, v_cache, backend, num_layers)
        token = argmax(model.compute_logits(hidden))  # i32[R]
        return token, drafts.at[:, j].set(token), k_cache, v_cache

    drafts = jnp.zeros((num_rows, max_drafts), jnp.int32)
    _, drafts, k_cache, v_cache = jax.lax.fori_loop(
        0, max_drafts, draft, (input_ids[start], drafts, k_cache, v_cache))
    slots = jnp.arange(max_drafts, dtype=jnp.int32)[None, :]
    targets = jnp.where(slots < num_drafts[:, None], start[:, None] + 1 + slots,
                        input_ids.shape[0])                           # out of range: dropped
    return input_ids.at[targets].set(drafts, mode="drop"), drafts, k_cache, v_cache
