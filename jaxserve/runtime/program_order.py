"""The programs of a compiled directory a starting engine needs first, loaded on a background
thread while the weights are read (`LoadedPrograms.load_in_background`): a directory holds
every bucket's programs and a 30-layer step program takes about a second to deserialise on
CPU. A first request's prefill bucket cannot be known ahead: one prefill bucket loads first,
which a first prompt that fits runs in, padded, until its own bucket's program is loaded."""

from __future__ import annotations

from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.programs.resolved import ResolvedPlan
from jaxserve.programs.device_step import ProgramKey, step_key
from jaxserve.programs.input_batch import StepArrays, pack
from jaxserve.programs.step_shapes import warm_up_programs
from jaxserve.runtime.compiled_dir import KV_INIT


# A chat prompt in its template fits (SmolLM2's, its default system prompt included).
FIRST_PROMPT_TOKENS = 64


def planned_programs(cfg: LlamaConfig, plan: ResolvedPlan,
                     ) -> list[tuple[StepArrays, SamplingMetadata]]:
    """The steps warm-up runs for an engine with this model (`warm_up_programs`)."""
    return warm_up_programs(plan.token_buckets, plan.request_buckets,
                            plan.blocks_per_seq, cfg.eos_token_ids, plan.max_logprobs,
                            cfg.vocab_size, plan.num_speculative_tokens)


def first_programs(programs: list[tuple[StepArrays, SamplingMetadata]]) -> list[ProgramKey]:
    """The keys of the programs a starting engine needs first: the KV pool's; the smallest
    prefill bucket that holds FIRST_PROMPT_TOKENS tokens (else the largest), which a start's
    first prompts run in until their own buckets' programs load (model_runner pads a step
    into a loaded bucket), with the fewest requests; the one-token decode step; and the
    samplers of both. The rest load when first used: loading them all at once would take the
    cores the weights and the first steps need."""
    plain = [arrays for arrays, _ in programs if not arrays.device_drafts]
    decode = min(plain, key=lambda a: (len(a.input_ids), len(a.seq_lens)))
    holding = [a for a in plain if len(a.input_ids) >= FIRST_PROMPT_TOKENS]
    prefill = (min(holding, key=lambda a: (len(a.input_ids), len(a.seq_lens))) if holding
               else max(plain, key=lambda a: (len(a.input_ids), -len(a.seq_lens))))
    rows = {len(decode.logits_indices), len(prefill.logits_indices)}
    return [KV_INIT, step_key(prefill), step_key(decode), *dict.fromkeys(
        ("sample", pack(sampling)[1]) for arrays, sampling in programs
        if len(arrays.logits_indices) in rows)]
