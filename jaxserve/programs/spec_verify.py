"""Verifying drafts: which of a request's drafts the target model accepts.

Every draft here is a single token proposed deterministically (an n-gram lookup, or a draft
model's argmax), so its proposal distribution q is one-hot. Rejection sampling (Leviathan et
al.) accepts draft x with probability min(1, p(x) / q(x)) = p(x) and, on rejection, samples
from the residual max(p - q, 0), which is p with x removed and renormalised. Sampling y ~ p
at the draft's position and accepting exactly when y == x does both at once: P(accept) = p(x),
and a rejected y is distributed as p given y != x. So the step samples every draft position
with the ordinary sampler (its own seeded key, filters and temperature), and a request's
tokens are its longest run of drafts equal to what was sampled, then the sample after that run:
the target's distribution, token by token, and greedy's argmax exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.attention import AttentionMetadata


def accepted_tokens(sampled: np.ndarray, accepted: np.ndarray,
                    sample_starts: np.ndarray) -> list[list[int]]:
    """sampled i32[S]: the token sampled at every sample row; accepted i32[S]: the drafts each
    row's request accepted (`accepted_drafts`); request i's rows are sample_starts[i] ..
    sample_starts[i + 1] - 1 (one per draft, then its own). Per request: its accepted drafts,
    which are the samples at their rows, and the token sampled after them."""
    starts = sample_starts[:-1].tolist()
    # Python lists: numpy's gather from the fetched samples took ~25 us here, 10x its cost on
    # arrays of its own (stories260K, a drafting step of one request)
    tokens, counts = sampled.tolist(), accepted.tolist()
    return [tokens[a:a + counts[a] + 1] for a in starts]


# ---- on the device: a step scheduled while the one before it ran (async scheduling) ----------

def resolve_previous_step(
    input_ids: jax.Array,  # i32[T]
    prev_rows: jax.Array,  # i32[T]  -1, or the first sample row, in the step before, of the
    #                        request whose sample this input is
    md: AttentionMetadata,
    prev_sampled: jax.Array,  # i32[max rows]  the step before's samples
    prev_accepted: jax.Array,  # i32[max rows]  drafts accepted by each row's request there
    prev_base: jax.Array,  # i32[R]  each request's first sample row in the step before; -1
    prev_drafts: jax.Array,  # i32[R]  the drafts it carried there
    block_size: int,
) -> tuple[jax.Array, AttentionMetadata, jax.Array]:
    """The step's inputs as the step before it turned out. It was scheduled as if that step
    accepted every draft: an input it samples is its sample after the drafts it accepted, and a
    request whose drafts it rejected moves back as many positions (its KV slots with them).
    Returns (input_ids, md, i32[T] how far back each token moved)."""
    rows = jnp.maximum(prev_rows, 0)
    input_ids = jnp.where(prev_rows >= 0, prev_sampled[rows + prev_accepted[rows]], input_ids)
    R = prev_base.shape[0]
    shift = jnp.where(prev_base >= 0, prev_drafts - prev_accepted[jnp.maximum(prev_base, 0)],
                      0)  # i32[R]
    req = token_requests(md.query_start_loc, input_ids.shape[0])
    token_shift = jnp.where(req < R, shift[jnp.minimum(req, R - 1)], 0)  # padding: 0
    positions = md.positions - token_shift
    slots = (md.block_tables[jnp.minimum(req, R - 1), positions // block_size] * block_size
             + positions % block_size)
    md = dataclasses.replace(md, positions=positions, seq_lens=md.seq_lens - shift,
                             slot_mapping=jnp.where(token_shift > 0, slots, md.slot_mapping))
    return input_ids, md, token_shift


def token_requests(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: each token row's request (R for padding rows past the last request's)."""
    return jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens, dtype=jnp.int32),
                            side="right", method="compare_all").astype(jnp.int32)


def sample_rows(
    input_ids: jax.Array,  # i32[T]  the step's inputs, drafts in place
    query_start_loc: jax.Array,  # i32[R + 1]
    logits_indices: jax.Array,  # i32[S]
    draft_starts: jax.Array,  # i32[R]  each request's last known token's row
    num_drafts: jax.Array,  # i32[R]
    token_shift: jax.Array,  # i32[T]  from `resolve_previous_step`
) -> jax.Array:  # i32[3, S]
    """Per sample row: the draft that follows it (-1 on each request's last row), its
    request's first sample row, and how far back its request moved (the sampler's step keys
    move with it)."""
    T, R, S = input_ids.shape[0], draft_starts.shape[0], logits_indices.shape[0]
    req = jnp.minimum(token_requests(query_start_loc, T)[logits_indices], R - 1)
    offset = logits_indices - draft_starts[req]  # the row's place among its request's rows
    has_draft = (offset >= 0) & (offset < num_drafts[req])
    drafts = jnp.where(has_draft, input_ids[jnp.minimum(logits_indices + 1, T - 1)], -1)
    first = jnp.clip(jnp.arange(S, dtype=jnp.int32) - jnp.maximum(offset, 0), 0, S - 1)
    return jnp.stack([drafts, first, token_shift[logits_indices]])


def accepted_drafts(sampled: jax.Array, rows: jax.Array) -> jax.Array:
    """i32[S]: per sample row (sampled i32[S]; rows: `sample_rows`), the drafts its request
    accepted: its run of rows whose sample equals the draft after it (a request's last row has
    none, which ends the run)."""
    S = sampled.shape[0]
    drafts, first = rows[0], rows[1]
    index = jnp.arange(S, dtype=jnp.int32)
    first_miss = jax.lax.cummin(jnp.where(sampled == drafts, S, index), reverse=True)
    return first_miss[first] - first
