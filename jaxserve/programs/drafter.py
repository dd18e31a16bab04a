"""Drafters: how a speculative step proposes its drafts on the device (programs/spec_step.py),
one per `speculative_config.method`. A drafter is a static, hashable description; what it
keeps on the device between steps is its cache, a tuple of arrays over the KV blocks that the
step donates and returns (n-gram's token cache, the draft model's KV caches; nothing for
layer skip), beside its weights (the draft model's; nothing for the others).

Every step of a speculative engine lets its drafter `observe` the inputs the target computed
(drafts in place), so the cache stays complete; a drafting step first has it `propose` up to
`max_drafts` drafts per request into the inputs' draft slots (programs/device_drafts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.config import EngineConfig
from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.models.llama import Llama
from jaxserve.programs.device_drafts import propose_drafts, propose_ngram_drafts, write_tokens
from jaxserve.programs.device_step import replicated
from jaxserve.programs.draft_model import catch_up

DrafterCache = tuple[jax.Array, ...]  # donated in, returned by every speculative step


@dataclass(frozen=True)
class Proposal:
    """A drafting step's view of its inputs, and what `propose` hands back."""
    input_ids: jax.Array  # i32[T]  drafts as placeholders, then in place
    k_cache: jax.Array  # the target's caches (layer skip writes its drafts' KV there)
    v_cache: jax.Array
    drafter_cache: DrafterCache


class Drafter(Protocol):
    max_drafts: int  # the most drafts a request proposes in one step

    def propose(self, target: Llama, weights: Any, backend: AttentionBackend,
                p: Proposal, md: AttentionMetadata, draft_starts: jax.Array,
                num_drafts: jax.Array) -> Proposal:
        """`p` with the drafts in input_ids (draft_starts i32[R]: each request's last known
        token's row; num_drafts i32[R]: its drafts, 0 for none)."""
        ...

    def observe(self, weights: Any, backend: AttentionBackend, cache: DrafterCache,
                input_ids: jax.Array, md: AttentionMetadata) -> DrafterCache:
        """The cache after the target's pass over `input_ids` (drafts in place)."""
        ...

    def pin(self, cache: DrafterCache, kv_sharding: NamedSharding) -> DrafterCache:
        """The cache in the layout it was donated in."""
        ...


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup over the token cache, i32[NB, BS]: the token id at every KV slot."""
    min_n: int
    max_n: int
    max_drafts: int

    def propose(self, target: Llama, weights: Any, backend: AttentionBackend,
                p: Proposal, md: AttentionMetadata, draft_starts: jax.Array,
                num_drafts: jax.Array) -> Proposal:
        # The lookup reads this step's own inputs too (the tokens just before the drafts).
        (token_cache,) = self.observe(weights, backend, p.drafter_cache, p.input_ids, md)
        input_ids, _ = propose_ngram_drafts(token_cache, self.min_n, self.max_n,
                                            self.max_drafts, p.input_ids, md, draft_starts,
                                            num_drafts)
        return Proposal(input_ids, p.k_cache, p.v_cache, (token_cache,))

    def observe(self, weights: Any, backend: AttentionBackend, cache: DrafterCache,
                input_ids: jax.Array, md: AttentionMetadata) -> DrafterCache:
        return (write_tokens(cache[0], input_ids, md),)

    def pin(self, cache: DrafterCache, kv_sharding: NamedSharding) -> DrafterCache:
        return (jax.lax.with_sharding_constraint(cache[0], replicated(kv_sharding)),)


@dataclass(frozen=True)
class LayerSkipDrafter:
    """The target's first `num_layers` layers draft, writing the target's own KV (the same
    weights, tokens and positions): no cache of its own."""
    num_layers: int
    max_drafts: int

    def propose(self, target: Llama, weights: Any, backend: AttentionBackend,
                p: Proposal, md: AttentionMetadata, draft_starts: jax.Array,
                num_drafts: jax.Array) -> Proposal:
        input_ids, k_cache, v_cache = propose_drafts(
            target, self.num_layers, backend, self.max_drafts, p.input_ids, md, draft_starts,
            num_drafts, p.k_cache, p.v_cache)
        return Proposal(input_ids, k_cache, v_cache, p.drafter_cache)

    def observe(self, weights: Any, backend: AttentionBackend, cache: DrafterCache,
                input_ids: jax.Array, md: AttentionMetadata) -> DrafterCache:
        return cache

    def pin(self, cache: DrafterCache, kv_sharding: NamedSharding) -> DrafterCache:
        return cache


@dataclass(frozen=True)
class DraftModelDrafter:
    """A smaller checkpoint (programs/draft_model.py) drafts over its own KV caches (k, v),
    [L_d, Hkv_d, NB, BS, D_d], which every step's catch-up keeps complete."""
    graphdef: nnx.GraphDef
    max_drafts: int

    def propose(self, target: Llama, weights: Any, backend: AttentionBackend,
                p: Proposal, md: AttentionMetadata, draft_starts: jax.Array,
                num_drafts: jax.Array) -> Proposal:
        input_ids, k_cache, v_cache = propose_drafts(
            nnx.merge(self.graphdef, weights), None, backend, self.max_drafts, p.input_ids, md,
            draft_starts, num_drafts, *p.drafter_cache)
        return Proposal(input_ids, p.k_cache, p.v_cache, (k_cache, v_cache))

    def observe(self, weights: Any, backend: AttentionBackend, cache: DrafterCache,
                input_ids: jax.Array, md: AttentionMetadata) -> DrafterCache:
        return catch_up(nnx.merge(self.graphdef, weights), backend, input_ids, md, *cache)

    def pin(self, cache: DrafterCache, kv_sharding: NamedSharding) -> DrafterCache:
        return tuple(jax.lax.with_sharding_constraint(c, kv_sharding) for c in cache)


def make_drafter(config: EngineConfig, draft_graphdef: nnx.GraphDef | None) -> Drafter | None:
    """The engine's drafter (`draft_graphdef`: the draft model's, with method draft_model);
    None without speculation."""
    spec = config.scheduler.speculative_config
    if spec is None:
        return None
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, k)
    if spec.method == "layer_skip":
        return LayerSkipDrafter(spec.num_layers, k)
    assert draft_graphdef is not None, "method draft_model: the draft model is loaded"
    return DraftModelDrafter(draft_graphdef, k)
