"""Drafts proposed on the device, inside the step (its drafting program: steps without drafts
run the plain one), before the target's pass. The drafts become the step's inputs after each
request's last token, for the target to verify. Proposed there, they follow the tokens the
step before really accepted, even when this step was scheduled before that one finished
(async scheduling).

- n-gram (prompt lookup): from the request's own tokens, which every step writes into a token
  cache beside the KV cache (one token id per KV slot), read through its block table.
- layer skip: `num_drafts` greedy decode iterations of the target's own first `num_layers`
  layers, the final norm and the LM head. Those layers' KV is the target's own (same weights,
  tokens, positions), so the drafts write it straight into the target's cache at the draft
  slots the scheduler allocated; the verifying pass then rewrites those slots. No second
  cache, no second prefill.
- a draft model (programs/draft_model.py): the same iterations through a smaller checkpoint
  with its own cache over the same blocks, kept complete by the catch-up pass every step runs
  after the target's.

A model's iteration 0 decodes each request's last known token (writing its KV at its
position), and iteration j the draft j before it, at the slots the scheduler allocated for the
drafts.
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
                   v_cache: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draft with `model` (its first `num_layers` layers; None: all) over its own caches.
    input_ids i32[T]: the step's inputs (drafts as placeholders); draft_starts i32[R]: each
    request's last known token (its row in the step), num_drafts i32[R]: its drafts (0: none).
    Returns (input_ids with the drafts in place, k_cache, v_cache)."""
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
    return place_drafts(input_ids, drafts, start, num_drafts), k_cache, v_cache


def write_tokens(token_cache: jax.Array, input_ids: jax.Array, md: AttentionMetadata,
                 ) -> jax.Array:
    """token_cache i32[NB, BS] with the step's inputs at their KV slots (padding writes the
    null block, as its KV does)."""
    flat = token_cache.reshape(-1).at[md.slot_mapping].set(input_ids)
    return flat.reshape(token_cache.shape)


def propose_ngram_drafts(token_cache: jax.Array, min_n: int, max_n: int, max_drafts: int,
                         input_ids: jax.Array, md: AttentionMetadata, draft_starts: jax.Array,
                         num_drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup drafts from each drafting request's tokens as `token_cache` holds them
    (i32[NB, BS], this step's inputs written): for the longest n in [min_n, max_n] whose last
    n tokens occurred earlier, the tokens after their earliest occurrence (vLLM's proposer picks
    the same one), the span from there to the end repeated as often as it takes (a loop shorter
    than the drafts still fills them, like an LZ77 copy overlapping its output); without a
    match, the last token repeated. Returns (input_ids with the drafts in place, drafts
    i32[R, max_drafts])."""
    num_rows, pages = md.block_tables.shape
    width = pages * token_cache.shape[1]
    history = token_cache[md.block_tables].reshape(num_rows, width)   # i32[R, W]
    start = jnp.maximum(draft_starts, 0)
    length = md.positions[start] + 1                                  # i32[R] known tokens
    back = jnp.arange(max_n, dtype=jnp.int32)[None, :]
    # i32[R, max_n]: the last token, the one before it, ...
    last = jnp.take_along_axis(history, jnp.maximum(length[:, None] - 1 - back, 0), axis=1)
    ends = jnp.arange(width, dtype=jnp.int32)[None, :]
    # An earlier window ends at j <= length - 2, so a token follows it.
    has_next = ends <= length[:, None] - 2
    matched = jnp.ones((num_rows, width), bool)  # the window of n tokens ending at j matches
    end = length - 2  # no match: the copy starts at the last token
    for n in range(1, max_n + 1):
        same = history == last[:, n - 1:n]                            # bool[R, W]
        matched &= jnp.pad(same, ((0, 0), (n - 1, 0)))[:, :width]     # history[j - n + 1]
        if n >= min_n:
            earliest = jnp.min(jnp.where(matched & has_next, ends, width), axis=1)
            end = jnp.where((earliest < width) & (n <= length - 1), earliest, end)
    first = end + 1                                                   # i32[R]
    offsets = jnp.arange(max_drafts, dtype=jnp.int32)[None, :] % (length - first)[:, None]
    drafts = jnp.take_along_axis(history, first[:, None] + offsets, axis=1)
    return place_drafts(input_ids, drafts, start, num_drafts), drafts


def place_drafts(input_ids: jax.Array, drafts: jax.Array, start: jax.Array,
                 num_drafts: jax.Array) -> jax.Array:
    """input_ids with row r's first num_drafts[r] drafts after its last known token (at
    start[r])."""
    slots = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None, :]
    targets = jnp.where(slots < num_drafts[:, None], start[:, None] + 1 + slots,
                        input_ids.shape[0])                           # out of range: dropped
    return input_ids.at[targets].set(drafts, mode="drop")
