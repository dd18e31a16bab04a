"""A speculative engine's model step: the plain step's pieces (programs/device_step.py) around
its drafter (programs/drafter.py). A drafting step has the drafter propose its drafts into the
inputs first; every step then runs the target and lets the drafter observe what it computed.
The drafter's weights and its cache (donated, like the target's caches) are arguments; a step
that drafts nothing is a separate program, which proposes nothing."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from flax import nnx

from jaxserve.layers.sampler import TokenLogprobs, token_logprobs
from jaxserve.programs.device_step import (Forward, PrevSamples, Statics, StepStatics, _step,
                                           _step_prompt_logprobs, read_inputs, rows_of,
                                           run_model)
from jaxserve.programs.drafter import Drafter, DrafterCache, Proposal
from jaxserve.programs.input_batch import PackedLayout


class SpecStatics(Statics):
    """A speculative step's statics: the model's, the drafter, and whether it proposes."""

    def __init__(self, step: StepStatics, drafter: Drafter, proposes: bool):
        self.step, self.drafter, self.proposes = step, drafter, proposes
        super().__init__((step, drafter, proposes))


class SpecStepOutputs(NamedTuple):
    k_cache: jax.Array  # the donated caches, written
    v_cache: jax.Array
    drafter_cache: DrafterCache  # donated, written
    logits: jax.Array  # f32[S, V]
    rows: jax.Array  # i32[3, S]  spec_verify.sample_rows: the sampler's row drafts and shifts


def _spec_forward(statics: SpecStatics, layout: PackedLayout, state: nnx.State,
                  k_cache: jax.Array, v_cache: jax.Array, drafter_weights: Any,
                  drafter_cache: DrafterCache, prev: PrevSamples, inputs: jax.Array,
                  ) -> Forward:
    step, drafter = statics.step, statics.drafter
    x = read_inputs(layout, prev, inputs, block_size=k_cache.shape[3])
    model = nnx.merge(step.graphdef, state)
    p = Proposal(x.input_ids, k_cache, v_cache, drafter_cache)
    if statics.proposes:
        p = drafter.propose(model, drafter_weights, step.backend, p, x.md, x.draft_starts,
                            x.num_drafts)
    hidden, k_cache, v_cache = run_model(step, model, p.input_ids, x.md, p.k_cache, p.v_cache)
    drafter_cache = drafter.pin(drafter.observe(drafter_weights, step.backend, p.drafter_cache,
                                                p.input_ids, x.md), step.kv_sharding)
    sample_hidden = hidden[x.logits_indices]
    return Forward(model, hidden, sample_hidden, SpecStepOutputs(
        k_cache, v_cache, drafter_cache, model.compute_logits(sample_hidden),
        rows_of(step, x, p.input_ids)))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4, 6))
def _spec_step(statics: SpecStatics, layout: PackedLayout, state: nnx.State,
               k_cache: jax.Array, v_cache: jax.Array, drafter_weights: Any,
               drafter_cache: DrafterCache, prev: PrevSamples, inputs: jax.Array,
               ) -> SpecStepOutputs:
    """With the drafter's weights (none: {}) and its cache (donated)."""
    return _spec_forward(statics, layout, state, k_cache, v_cache, drafter_weights, drafter_cache,
                         prev, inputs).out


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5, 7))
def _spec_step_prompt_logprobs(statics: SpecStatics, layout: PackedLayout, num_top: int,
                               state: nnx.State, k_cache: jax.Array, v_cache: jax.Array,
                               drafter_weights: Any, drafter_cache: DrafterCache,
                               prev: PrevSamples, inputs: jax.Array, targets: jax.Array,
                               ) -> tuple[SpecStepOutputs, TokenLogprobs]:
    """`_spec_step`, plus every token row's logprob of `targets` (as device_step's
    `_step_prompt_logprobs`)."""
    f = _spec_forward(statics, layout, state, k_cache, v_cache, drafter_weights, drafter_cache,
                      prev, inputs)
    return f.out, token_logprobs(f.model.compute_logits(f.hidden), targets, num_top)



def engine_statics(plain: StepStatics, verifying: StepStatics, drafter: Drafter | None,
                   ) -> tuple[StepStatics | SpecStatics, ...]:
    """The statics of an engine's model programs, indexed by whether a step drafts on the
    device (StepArrays.device_drafts): the plain step's alone without a drafter."""
    if drafter is None:
        return (plain,)
    return SpecStatics(plain, drafter, False), SpecStatics(verifying, drafter, True)


def model_step(statics: StepStatics | SpecStatics, prompt_logprobs: bool = False) -> Any:
    """The jitted model step that takes `statics` (with every token row's prompt logprobs)."""
    if isinstance(statics, SpecStatics):
        return _spec_step_prompt_logprobs if prompt_logprobs else _spec_step
    return _step_prompt_logprobs if prompt_logprobs else _step
