"""The on-device sampler: penalties, temperature, min-p/top-k/top-p, seeded sampling, logprobs.

`sample` is pure JAX and runs inside the engine's jitted step: static shapes, no host syncs.
Its inputs are built on the host from each row's `SamplingParams` by
`programs/input_batch.py`'s `make_sampling_metadata`.

Order (vLLM V1's): min_tokens blocking and penalties on the raw logits; greedy rows take the
argmax of those; sampled rows divide by temperature, keep min-p, then top-k, then top-p (over
the renormalised survivors), and draw with a Gumbel-max on the row's own key
`fold_in(key(seed), step)`, so a row's token depends on nothing else in the batch.
Logprobs are of the raw model distribution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "seeds", "steps",
                 "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "output_token_ids", "prompt_token_ids", "blocked_token_ids", "bias_token_ids",
                 "bias_values", "token_bitmask"],
    meta_fields=["all_greedy", "num_logprobs"])
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array         # f32[R]      0 = greedy row
    top_k: jax.Array               # i32[R]      0 = off
    top_p: jax.Array               # f32[R]      1 = off
    min_p: jax.Array               # f32[R]      0 = off
    seeds: jax.Array               # u32[R]
    steps: jax.Array               # i32[R]      tokens sampled so far; the key is (seed, step)
    presence_penalty: jax.Array    # f32[R]
    frequency_penalty: jax.Array   # f32[R]
    repetition_penalty: jax.Array  # f32[R]
    output_token_ids: jax.Array    # i32[R, Lo]  -1 padded; Lo = 0 when no row has penalties
    prompt_token_ids: jax.Array    # i32[R, Lp]  -1 padded; Lp = 0 unless repetition penalty used
    # i32[R, B]  -1 padded; EOS/stop ids before min_tokens, bad words' next tokens
    blocked_token_ids: jax.Array
    bias_token_ids: jax.Array      # i32[R, K]   -1 padded; logit_bias's tokens (K = 0: none)
    bias_values: jax.Array         # f32[R, K]   added to those tokens' logits
    # i32[R, W]  structured outputs: bit t % 32 of word t // 32 allows token t (free rows all
    # ones); W = ceil(V / 32), or 0 when no row of the step is constrained
    token_bitmask: jax.Array
    all_greedy: bool               # static: argmax only, no filters, no noise
    num_logprobs: int              # static: top-n logprobs of every row; 0: no row wants any


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["sampled", "logprob", "rank", "topk_ids", "topk_logprobs"],
                   meta_fields=[])
@dataclass(frozen=True)
class SamplerOutput:
    sampled: jax.Array        # i32[R]
    logprob: jax.Array        # f32[R]               raw logprob of the sampled token
    rank: jax.Array           # i32[R]  1 + tokens likelier than it; 0 when num_logprobs is 0
    topk_ids: jax.Array       # i32[R, num_logprobs]
    topk_logprobs: jax.Array  # f32[R, num_logprobs]


# ----------------------------------------------------------------------------- device side

def _scatter_index(token_ids: jax.Array, vocab_size: int) -> jax.Array:
    # -1 padding must not wrap to the last token: send it out of range, where mode="drop" skips it.
    return jnp.where(token_ids < 0, vocab_size, token_ids)


def _block_tokens(logits: jax.Array, blocked_token_ids: jax.Array) -> jax.Array:
    if blocked_token_ids.shape[1] == 0:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = _scatter_index(blocked_token_ids, logits.shape[1])
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def _add_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    if md.bias_token_ids.shape[1] == 0:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = _scatter_index(md.bias_token_ids, logits.shape[1])
    return logits.at[rows, ids].add(md.bias_values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf for the tokens a row's grammar does not allow next."""
    num_rows, vocab_size = logits.shape
    if bitmask.shape[1] == 0:
        return logits
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[R, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size] != 0            # bool[R, V]
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output) penalties."""
    num_rows, vocab_size = logits.shape
    if md.output_token_ids.shape[1] == 0 and md.prompt_token_ids.shape[1] == 0:
        return logits
    rows = jnp.arange(num_rows)[:, None]
    out_ids = _scatter_index(md.output_token_ids, vocab_size)
    out_counts = jnp.zeros((num_rows, vocab_size), jnp.int32).at[rows, out_ids].add(
        1, mode="drop")                                        # i32[R, V]
    in_output = out_counts > 0
    prompt_ids = _scatter_index(md.prompt_token_ids, vocab_size)
    seen = in_output.at[rows, prompt_ids].set(True, mode="drop")  # bool[R, V]

    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * out_counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _order_key(x: jax.Array) -> jax.Array:
    """u32 keys that sort like the f32 values x (flip negatives, set the sign bit of the rest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_value(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(x: jax.Array, lo: jax.Array,
                       ok: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """f32[R]: per row, the largest value t of x with ok(t), where ok holds at lo (a u32 key) and
    fails above the row max. ok must be monotone (true below some point, false above it).

    A bisection over the 2**32 float keys: 32 masked reductions over [R, V] instead of sorting
    the vocabulary, and 5-30x faster than the sort on CPU (same thresholds, bit for bit).
    """
    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        good = ok(_key_value(mid))
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    hi = _order_key(x.max(axis=-1)) + 1
    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return _key_value(lo)


def filter_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     min_p: jax.Array) -> jax.Array:
    """f32[R]: the smallest scaled logit each row keeps after min-p, top-k and top-p.

    Each filter keeps a prefix of the descending order, so one threshold per row covers all
    three; ties at the threshold are all kept. top-p keeps the shortest prefix whose mass,
    renormalised over what min-p and top-k left, reaches top_p.
    """
    vocab_size = scaled.shape[1]
    rel_probs = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True))     # f32[R, V]  p_i / p_max
    t_min_p = jnp.min(jnp.where(rel_probs >= min_p[:, None], scaled, jnp.inf), axis=-1)
    k = jnp.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    t_top_k = _largest_threshold(scaled, _order_key(scaled.min(axis=-1)),
                                 lambda t: jnp.sum(scaled >= t[:, None], axis=-1) >= k)
    t_kept = jnp.maximum(t_min_p, t_top_k)

    def mass_at_least(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(scaled >= t[:, None], rel_probs, 0.0), axis=-1)

    target = top_p * mass_at_least(t_kept)
    t_top_p = _largest_threshold(scaled, _order_key(t_kept), lambda t: mass_at_least(t) >= target)
    return jnp.where(top_p >= 1.0, t_kept, t_top_p)


def argmax(x: jax.Array) -> jax.Array:
    """i32[...]: jnp.argmax over the last axis (the first maximum; the first NaN if any) as a
    max, then the least index holding it: two plain reductions, which XLA:CPU runs ~4x faster
    than argmax's reduction over (value, index) pairs (over the dummy model's 8192 logits)."""
    hit = (x == x.max(axis=-1, keepdims=True)) | jnp.isnan(x)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _row_noise(seed: jax.Array, step: jax.Array, vocab_size: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.gumbel(key, (vocab_size,), jnp.float32)


def _sample_random(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    num_rows, vocab_size = logits.shape
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)
    scaled = logits / temperature[:, None]
    any_filter = jnp.any(((md.top_k > 0) & (md.top_k < vocab_size)) | (md.top_p < 1.0)
                         | (md.min_p > 0.0))
    # The threshold search is the sampler's one expensive op: skip it when no row filters.
    threshold = jax.lax.cond(any_filter, filter_threshold,
                             lambda s, *_: jnp.full((num_rows,), -jnp.inf, jnp.float32),
                             scaled, md.top_k, md.top_p, md.min_p)
    scaled = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    noise = jax.vmap(_row_noise, in_axes=(0, 0, None))(md.seeds, md.steps, vocab_size)
    return argmax(scaled + noise)


def sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    """logits f32[R, V] (any float dtype) -> one token per row, with raw logprobs."""
    num_rows = logits.shape[0]
    if md.temperature.shape != (num_rows,):
        raise ValueError(f"logits must have one row per metadata row "
                         f"({md.temperature.shape[0]}), got shape {logits.shape}")
    logits = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)                          # f32[R]

    # logprobs stay those of the model's own logits (vLLM's default, raw_logprobs)
    masked = apply_token_bitmask(_add_bias(logits, md), md.token_bitmask)
    processed = apply_penalties(_block_tokens(masked, md.blocked_token_ids), md)
    sampled = argmax(processed)
    if not md.all_greedy:
        sampled = jnp.where(md.temperature == 0, sampled, _sample_random(processed, md))

    sampled_logit = jnp.take_along_axis(logits, sampled[:, None], axis=-1)  # f32[R, 1]
    if md.num_logprobs > 0:
        rank = 1 + jnp.sum(logits > sampled_logit, axis=-1).astype(jnp.int32)
        top_values, topk_ids = jax.lax.top_k(logits, md.num_logprobs)
        topk_logprobs = top_values - log_norm[:, None]
    else:
        rank = jnp.zeros((num_rows,), jnp.int32)
        topk_ids = jnp.zeros((num_rows, 0), jnp.int32)
        topk_logprobs = jnp.zeros((num_rows, 0), jnp.float32)
    return SamplerOutput(sampled, sampled_logit[:, 0] - log_norm, rank,
                         topk_ids.astype(jnp.int32), topk_logprobs)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logprob", "rank", "topk_ids", "topk_logprobs"], meta_fields=[])
@dataclass(frozen=True)
class TokenLogprobs:
    """Per token row: the log-probability and rank of a given next token, and the top-k."""
    logprob: jax.Array        # f32[T]
    rank: jax.Array           # i32[T]     1 + the number of tokens more likely than the target
    topk_ids: jax.Array       # i32[T, K]
    topk_logprobs: jax.Array  # f32[T, K]


def token_logprobs(logits: jax.Array, targets: jax.Array, num_top: int) -> TokenLogprobs:
    """logits f32[T, V], targets i32[T] -> raw log-softmax of each target, its rank, top-k."""
    logits = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)                          # f32[T]
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)  # f32[T, 1]
    rank = 1 + jnp.sum(logits > target_logit, axis=-1).astype(jnp.int32)
    if num_top > 0:
        top_values, topk_ids = jax.lax.top_k(logits, num_top)
    else:
        top_values = jnp.zeros((logits.shape[0], 0), jnp.float32)
        topk_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return TokenLogprobs(target_logit[:, 0] - log_norm, rank, topk_ids.astype(jnp.int32),
                         top_values - log_norm[:, None])
