"""Starting from a compiled directory without waiting for it: the programs a starting engine
needs first, and the bucket a step takes while they load.

A directory holds every bucket's programs and a 30-layer step program takes about a second
to deserialise on CPU. So the KV pool's program, the largest step's and its sampler's load on
a background thread while the weights are read (`LoadedPrograms.load_in_background`), and a
step whose own bucket's program is not loaded takes the smallest loaded one that fits it
while its own loads behind it. Padding rows change no token, so the first request is
answered without waiting for its own bucket's program.
"""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.executor.compiled_dir import KV_INIT, LoadedPrograms
from jaxserve.executor.device_step import ProgramKey, step_key
from jaxserve.executor.input_batch import StepArrays
from jaxserve.executor.packing import pack
from jaxserve.executor.step_shapes import (bucket_pairs, num_speculative_tokens, step_buckets,
                                           warm_up_programs)
from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.models.llama_config import LlamaConfig


def planned_programs(config: EngineConfig, cfg: LlamaConfig, max_model_len: int,
                     ) -> list[tuple[StepArrays, SamplingMetadata]]:
    """The steps warm-up runs for an engine with this model (`warm_up_programs`)."""
    token_buckets, request_buckets = step_buckets(config)
    return warm_up_programs(token_buckets, request_buckets,
                            -(-max_model_len // config.cache.block_size), cfg.eos_token_ids,
                            config.model.max_logprobs, cfg.vocab_size,
                            num_speculative_tokens(config))


def first_programs(programs: list[tuple[StepArrays, SamplingMetadata]]) -> list[ProgramKey]:
    """The keys of the programs a starting engine needs first: the KV pool's, the step of the
    most tokens and fewest requests (which any one request's first step fits) and the
    sampler of its rows. The rest load when first used, as loading them all at once would
    take the cores the weights and the first steps need."""
    steps = [arrays for arrays, _ in programs if not arrays.device_drafts]
    first = max(steps, key=lambda a: (len(a.input_ids), -len(a.seq_lens)))
    rows = len(first.logits_indices)
    return [KV_INIT, step_key(first), *dict.fromkeys(
        ("sample", pack(sampling)[1]) for arrays, sampling in programs
        if len(arrays.logits_indices) == rows)]

class ReadyBuckets:
    """The (token, request) bucket a step takes while its own bucket's program is not loaded."""

    def __init__(self, config: EngineConfig, max_blocks_per_seq: int) -> None:
        self.pairs = bucket_pairs(*step_buckets(config))
        self.max_blocks_per_seq = max_blocks_per_seq
        self._keys: dict[tuple[int, int], ProgramKey] = {}

    def choose(self, programs: LoadedPrograms, num_tokens: int, num_reqs: int,
               ) -> tuple[int, int] | None:
        """The smallest bucket holding the step whose (plain, draft-free) program is loaded,
        when the step's own bucket's is not: that one then loads in the background. None
        when the own one is loaded, or no other is (the step waits for its own)."""
        fitting = [pair for pair in self.pairs  # fewest tokens first, then fewest requests
                   if pair[0] >= num_tokens and pair[1] >= num_reqs]
        own = self._key(*fitting[0])
        if own not in programs or programs.ready(own):
            return None
        ready = next((pair for pair in fitting[1:] if programs.ready(self._key(*pair))), None)
        if ready is not None:
            programs.load_in_background([own])
        return ready

    def _key(self, T: int, R: int) -> ProgramKey:
        if (T, R) not in self._keys:
            self._keys[T, R] = step_key(StepArrays.empty(T, R, self.max_blocks_per_seq))
        return self._keys[T, R]
