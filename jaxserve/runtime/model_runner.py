"""ModelRunner: turns a SchedulerOutput into one device step and returns sampled ids.

A step is two jitted pure functions (programs/device_step.py): the model `(params, kv_caches,
batch) -> (kv_caches, logits)`, with the KV cache donated (with speculation, the step of
programs/spec_step.py, whose drafter's weights and cache are arguments too), then the sampler
`(logits, sampling) -> (sampled, logprobs)`, whose sampled ids and accepted-draft counts are
the one array the host reads back. The model's shapes come only from the bucket lists, so
after warm-up it never compiles again; the sampler's also depend on the padded token-history
widths that penalties need, and compiling a new width recompiles only the sampler. The runner
counts compilations and, in strict mode, raises on a new one.

A step may be launched before the previous one's sampled ids reach the host (async
scheduling): its decode inputs are then read from the previous step's ids on the device, and
its positions, scheduled as if that step accepted every draft, are corrected there from the
drafts it accepted (spec_verify.py).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from jaxserve.core.step_timing import StepTimings
from jaxserve.layers.attention import AttentionBackend
from jaxserve.layers.axes import AXIS
from jaxserve.layers.sampler import SamplerOutput, SamplingMetadata, TokenLogprobs
from jaxserve.models.llama import Llama
from jaxserve.placement.kv_blocks import (block_buckets, gather_blocks, pad_blocks,
                                          padded_block_ids, scatter_blocks)
from jaxserve.placement.mesh import replicate, to_host
from jaxserve.programs.resolved import ResolvedPlan
from jaxserve.placement.targets import chip_of
from jaxserve.programs.device_step import (PrevSamples, ProgramKey, StepOutputs, StepStatics,
                                           _sample, _step_pooled, sample_rows_shape,
                                           split_model, step_inputs, step_key, step_statics)
from jaxserve.programs.drafter import DrafterCache, make_drafter
from jaxserve.programs.input_batch import (InputBatch, PackedLayout, RowSpec, StepArrays,
                                           logprobs_width, make_sampling_metadata, pack)
from jaxserve.programs.prompt_logprobs import (PromptLogprobsPlan, finished_prompt_logprobs,
                                               plan_prompt_logprobs, record_prompt_logprobs)
from jaxserve.programs.spec_step import (SpecStatics, SpecStepOutputs, engine_statics,
                                         model_step)
from jaxserve.programs.spec_verify import accepted_tokens
from jaxserve.runtime.compiled_dir import LoadedPrograms
from jaxserve.runtime.program_order import planned_programs

logger = logging.getLogger(__name__)


class UnexpectedCompilationError(RuntimeError):
    pass


class PendingStep(NamedTuple):
    arrays: StepArrays
    rows: list[RowSpec]
    out: SamplerOutput  # device arrays, possibly still being computed
    ids: jax.Array  # i32[2, S]: the sampled ids, and the drafts each row's request accepted
    prompt_plan: PromptLogprobsPlan | None = None
    prompt_out: TokenLogprobs | None = None  # device arrays, with prompt_plan
    pooled: jax.Array | None = None  # f32[S, D]: a pooling engine's sample rows' hidden states


class _LastStep(NamedTuple):
    """What `time_last_step` re-runs: the last step's inputs and the cache it wrote (any other
    write to the cache makes a replay unsafe). The packed inputs are kept on the host: keeping
    their device copies alive made every decode step ~1.4x slower (dummy model, CPU)."""
    arrays: StepArrays
    layout: PackedLayout
    prev: PrevSamples
    inputs: np.ndarray  # packed, on the host
    sampling_layout: PackedLayout
    sampling_inputs: np.ndarray
    k_cache: weakref.ref[jax.Array]


def step_bitmask(sched: SchedulerOutput, arrays: StepArrays, num_rows: int,
                 ) -> np.ndarray | None:
    """i32[num_rows, W]: the scheduler's grammar bitmask at each constrained request's sample
    row (it has no drafts), all ones for free rows and padding; None when no row is
    constrained (the sampler's mask-free shape)."""
    if sched.grammar_bitmask is None:
        return None
    out = np.full((num_rows, sched.grammar_bitmask.shape[1]), -1, np.int32)
    rows = {req_id: int(arrays.sample_starts[i]) for i, req_id in enumerate(arrays.req_ids)}
    out[[rows[r] for r in sched.structured_output_req_ids]] = sched.grammar_bitmask
    return out


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Llama, k_cache: jax.Array, v_cache: jax.Array,
                 backend: AttentionBackend, mesh: Mesh, plan: ResolvedPlan,
                 eos_token_ids: tuple[int, ...], draft: Llama | None = None,
                 drafter_cache: DrafterCache = ()):
        """`draft`: the draft model (speculative `draft_model`); `drafter_cache`: the
        drafter's zeroed cache (programs/drafter.py)."""
        self.config = config
        self.pooling = config.model.pooling  # steps return the sample rows' hidden states
        self.mesh = mesh
        self.kv_sharding = k_cache.sharding
        self.model = model
        self.k_cache, self.v_cache = k_cache, v_cache
        self.drafter_cache = drafter_cache
        self.eos_token_ids = eos_token_ids
        self.plan = plan
        self.max_blocks_per_seq = plan.blocks_per_seq
        self.batch = InputBatch(plan.block_size, self.max_blocks_per_seq)
        self.block_buckets = block_buckets(self.max_blocks_per_seq)
        self.token_buckets, self.request_buckets = plan.token_buckets, plan.request_buckets
        self.num_drafts = plan.num_speculative_tokens
        # Module-level jits (_step, _sample): engines with the same model structure and step
        # shapes share compiled executables within a process.
        graphdef, self.params = split_model(model)
        draft_graphdef, self.drafter_weights = split_model(draft) if draft else (None, {})
        # The model's statics (steps without drafts), then each model program's.
        self.statics, verifying = step_statics(
            config, graphdef, backend, self.kv_sharding,
            chip_of(mesh.devices.flat[0].device_kind), model.cfg, model.dtype.itemsize)
        self.drafter = make_drafter(config, draft_graphdef)
        self.program_statics = engine_statics(self.statics, verifying, self.drafter)
        self.step_fns = tuple(model_step(statics) for statics in self.program_statics)
        # The last launched step's samples, and per request whose next input one of them is:
        # its first sample row there and its drafts.
        zeros = jax.device_put(np.zeros(plan.max_sample_rows, np.int32),
                               NamedSharding(mesh, P()))
        self.prev = PrevSamples(zeros, zeros)
        self.running_rows: dict[str, tuple[int, int]] = {}
        # Programs built ahead of time (a compiled directory), called directly: no tracing.
        self.executables: dict[ProgramKey, Any] | LoadedPrograms = {}
        self.compiled_shapes: set[tuple[Any, ...]] = set()
        self.timings = StepTimings()
        self._last_step: _LastStep | None = None
        self.num_compilations = 0
        self.warmed_up = False
        self.num_steps = 0

    # ---- one step ------------------------------------------------------------------------
    def dispatch(self, sched: SchedulerOutput) -> PendingStep | None:
        """Prepare and launch the step without waiting for the device (JAX dispatches
        asynchronously), so several data-parallel ranks can run at once."""
        with self.timings.phase("prep"):
            self.batch.update(sched)
            if sched.is_empty:
                return None
            arrays, packed = self._bucket_with_a_program(sched, self.batch.prepare(
                sched, self.token_buckets, self.request_buckets, self.running_rows,
                self.num_drafts))
            rows = self.batch.rows(arrays)
            # One logprobs width for every step that wants any: one shape.
            wants_logprobs = any(row.params.logprobs is not None for row in rows)
            num_rows = len(arrays.logits_indices)
            sampling = make_sampling_metadata(
                rows, num_rows, eos_token_ids=self.eos_token_ids,
                num_logprobs=(logprobs_width(self.plan.max_logprobs)
                              if wants_logprobs else 0),
                token_bitmask=step_bitmask(sched, arrays, num_rows))
            prompt_plan = plan_prompt_logprobs(
                arrays, [self.batch.requests[r] for r in arrays.req_ids],
                self.plan.max_logprobs) if self.batch.prompt_logprobs_ids else None
        with self.timings.phase("dispatch"):
            out, prompt_out, pooled, ids = self._run(arrays, sampling, prompt_plan, packed)
            pending = PendingStep(arrays, rows, out, ids, prompt_plan, prompt_out, pooled)
        self.batch.mark_pending(arrays)
        self.running_rows = {req_id: (int(arrays.sample_starts[i]), int(arrays.num_drafts[i]))
                             for i, req_id in enumerate(arrays.req_ids)
                             if arrays.completes_sequence[i]}
        return pending

    def _bucket_with_a_program(self, sched: SchedulerOutput, arrays: StepArrays,
                               ) -> tuple[StepArrays, tuple[np.ndarray, PackedLayout]]:
        """The step, packed; in a larger token bucket while a compiled directory's programs
        load, if its own program is not loaded and a larger one is: padding a step costs a
        fraction of the second that deserialising a many-layer program takes (program_order.py
        preloads one prefill bucket for a start's first prompts). Its own program then loads
        behind."""
        packed = step_inputs(arrays)
        programs = self.executables
        key = step_key(arrays, packed[1])
        if not isinstance(programs, LoadedPrograms) or key not in programs \
                or programs.loading_or_loaded(key):
            return arrays, packed
        for bucket in self.token_buckets:
            if bucket > len(arrays.input_ids):
                padded = self.batch.prepare(sched, [bucket], self.request_buckets,
                                            self.running_rows, self.num_drafts)
                padded_packed = step_inputs(padded)
                if programs.loading_or_loaded(step_key(padded, padded_packed[1])):
                    programs.load_in_background([key])
                    return padded, padded_packed
        return arrays, packed

    def collect(self, pending: PendingStep | None) -> ModelRunnerOutput:
        if pending is None:
            return ModelRunnerOutput([], [])
        arrays, rows, out, ids, prompt_plan, prompt_out, pooled = pending
        with self.timings.phase("device"):
            sampled, accepted = to_host(ids)[:, :len(rows)]  # the step's one device -> host wait
        with self.timings.phase("update"):
            if self.drafter is None:  # one sample row a request
                tokens = [[t] for t in sampled[:len(arrays.req_ids)].tolist()]
            else:
                tokens = accepted_tokens(sampled, accepted, arrays.sample_starts)
            self.batch.append_sampled(arrays, tokens)
            if prompt_out is not None:
                record_prompt_logprobs(prompt_plan, *(to_host(x) for x in (
                    prompt_out.logprob, prompt_out.rank, prompt_out.topk_ids,
                    prompt_out.topk_logprobs)))
        self.num_steps += 1
        wants_logprobs = out.topk_ids.shape[1] > 0
        return ModelRunnerOutput(
            arrays.req_ids, tokens,
            self._logprobs(out, rows, arrays.sample_starts, tokens) if wants_logprobs else None,
            finished_prompt_logprobs(arrays, self.batch.requests)
            if self.batch.prompt_logprobs_ids else {},
            {} if pooled is None else self._pooled(arrays, to_host(pooled)))

    def _run(self, arrays: StepArrays, sampling: SamplingMetadata,
             prompt_plan: PromptLogprobsPlan | None = None,
             packed: tuple[np.ndarray, PackedLayout] | None = None,
             ) -> tuple[SamplerOutput, TokenLogprobs | None, jax.Array | None, jax.Array]:
        """`packed`: `step_inputs(arrays)`, when the caller has it."""
        inputs, layout = packed or step_inputs(arrays)
        prev, prompt_out, pooled = self.prev, None, None
        shape = (len(arrays.input_ids), len(arrays.seq_lens), len(arrays.logits_indices),
                 arrays.device_drafts)
        if prompt_plan is not None:
            num_top = self.plan.max_logprobs
            self._count_shape(("step_prompt_logprobs", *shape, num_top))
            statics = self._statics(arrays)
            out, prompt_out = model_step(statics, prompt_logprobs=True)(
                statics, layout, num_top, *self._weights_and_caches(), prev,
                replicate(inputs, self.mesh), replicate(prompt_plan.targets, self.mesh))
            logits, rows = self._keep(out)
        elif self.pooling:
            self._count_shape(("step_pooled", *shape))
            out, pooled = _step_pooled(self.statics, layout, *self._weights_and_caches(), prev,
                                       replicate(inputs, self.mesh))
            logits, rows = self._keep(out)
        else:
            key = step_key(arrays, layout)
            if key not in self.executables:
                self._count_shape((key[0], *shape))
            logits, rows = self._call_step(arrays, key, prev, replicate(inputs, self.mesh))
        sampling_inputs, sampling_layout = pack(sampling)
        if ("sample", sampling_layout) not in self.executables:
            histories = (sampling.output_token_ids.shape[1], sampling.prompt_token_ids.shape[1],
                         sampling.blocked_token_ids.shape[1], sampling.bias_token_ids.shape[1])
            # Penalties' histories, blocked tokens (min_tokens, bad_words) and logit_bias come
            # in widths warm-up cannot enumerate: the sampler alone compiles for each on first
            # use (a fraction of a second), strict_compile or not.
            self._count_shape(("sample", len(arrays.logits_indices), *histories,
                               sampling.token_bitmask.shape[1], sampling.all_greedy,
                               sampling.num_logprobs), strict=not any(histories))
        out, self.prev, ids = self._call_sampler(sampling_layout, logits, prev, rows,
                                                 replicate(sampling_inputs, self.mesh))
        self._last_step = _LastStep(arrays, layout, prev, inputs, sampling_layout,
                                    sampling_inputs, weakref.ref(self.k_cache))
        return out, prompt_out, pooled, ids

    def _statics(self, arrays: StepArrays) -> StepStatics | SpecStatics:
        return self.program_statics[arrays.device_drafts]

    def _weights_and_caches(self) -> tuple[Any, ...]:
        """The step's leading array arguments: the target's weights and caches (donated), then
        with speculation the drafter's weights and cache (donated)."""
        target = (self.params, self.k_cache, self.v_cache)
        return target if self.drafter is None else (*target, self.drafter_weights,
                                                    self.drafter_cache)

    def _keep(self, out: StepOutputs | SpecStepOutputs) -> tuple[jax.Array, jax.Array]:
        """Hold the caches a step wrote; its (logits, rows) for the sampler."""
        self.k_cache, self.v_cache = out.k_cache, out.v_cache
        if isinstance(out, SpecStepOutputs):
            self.drafter_cache = out.drafter_cache
        return out.logits, out.rows

    def _call_step(self, arrays: StepArrays, key: ProgramKey, prev: PrevSamples,
                   inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The model step (`key`: from `step_key`): (logits f32[S, V], the sample rows' drafts
        and shifts i32[3, S])."""
        args = (*self._weights_and_caches(), prev, inputs)
        step = self.executables.get(key)
        if step is None:
            statics = self._statics(arrays)
            return self._keep(self.step_fns[arrays.device_drafts](statics, key[1], *args))
        return self._keep(step(*args))

    def _call_sampler(self, layout: PackedLayout, logits: jax.Array, prev: PrevSamples,
                      rows: jax.Array, inputs: jax.Array,
                      ) -> tuple[SamplerOutput, PrevSamples, jax.Array]:
        sample_fn = self.executables.get(("sample", layout))
        return (_sample(layout, logits, prev, rows, inputs) if sample_fn is None
                else sample_fn(logits, prev, rows, inputs))

    def time_step(self, arrays: StepArrays, repeats: int = 5) -> tuple[float, str]:
        """Best wall seconds, over `repeats`, of the model step program alone on `arrays` (a
        step the caller built, e.g. step_floor.scenario_step; it writes those arrays' KV
        slots), blocking each time; and the program's compiled HLO, for the cost model to read
        beside the time (scripts/device_check.py). Not for a serving engine's steps."""
        inputs, layout = step_inputs(arrays)
        key = step_key(arrays, layout)
        inputs = replicate(inputs, self.mesh)
        statics = self._statics(arrays)
        hlo = model_step(statics).lower(statics, layout, *self._weights_and_caches(), self.prev,
                                        inputs).compile().as_text()
        jax.block_until_ready(self._call_step(arrays, key, self.prev, inputs))  # compiles once
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(self._call_step(arrays, key, self.prev, inputs))
            best = min(best, time.perf_counter() - start)
        return best, hlo

    def time_last_step(self, repeats: int = 5) -> float:
        """Best wall seconds, over `repeats`, of the last launched step's compiled model and
        sampler programs re-run on the same device inputs, blocking each time: the step's
        device time plus two bare dispatches, without the host's input prep. The model program
        donates the caches as the step did and rewrites the same KV slots with the same values;
        the sampled ids are dropped: the engine's state is unchanged. Call between steps."""
        last = self._last_step
        if last is None or last.k_cache() is not self.k_cache:
            raise RuntimeError("time_last_step: no step was launched since the KV cache was "
                               "last written")
        jax.block_until_ready((self.k_cache, self.v_cache, self.drafter_cache, self.prev))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            logits, rows = self._call_step(last.arrays, step_key(last.arrays, last.layout),
                                              last.prev, replicate(last.inputs, self.mesh))
            jax.block_until_ready(self._call_sampler(
                last.sampling_layout, logits, last.prev, rows,
                replicate(last.sampling_inputs, self.mesh)))
            best = min(best, time.perf_counter() - start)
        self._last_step = last._replace(k_cache=weakref.ref(self.k_cache))
        return best

    @staticmethod
    def _pooled(arrays: StepArrays, hidden: np.ndarray) -> dict[str, np.ndarray]:
        """Per request this step takes to its last known token: its hidden state there."""
        return {req_id: hidden[arrays.sample_starts[i]] for i, req_id in enumerate(arrays.req_ids)
                if arrays.completes_sequence[i]}

    @staticmethod
    def _logprobs(out: SamplerOutput, rows: list[RowSpec], sample_starts: np.ndarray,
                  tokens: list[list[int]]) -> list[list[Logprobs] | None]:
        """Per request that asks: the logprobs of each of its tokens (at its sample rows)."""
        n = len(rows)
        sampled, lp, rank = (to_host(a)[:n] for a in (out.sampled, out.logprob, out.rank))
        ids, lps = to_host(out.topk_ids)[:n], to_host(out.topk_logprobs)[:n]
        result: list[list[Logprobs] | None] = []
        for start, request_tokens in zip(sample_starts, tokens):
            num_top = rows[start].params.logprobs
            result.append(None if num_top is None else [
                Logprobs(int(sampled[i]), float(lp[i]), int(rank[i]),
                         list(zip(ids[i, :num_top].tolist(), lps[i, :num_top].tolist())))
                for i in range(start, start + len(request_tokens))])
        return result

    # ---- whole KV blocks in and out (disaggregated prefill/decode) ------------------------
    def read_blocks(self, block_ids: list[int], heads: tuple[int, ...],
                    ) -> tuple[jax.Array, jax.Array]:
        """Dispatch a copy of these blocks' KV, `[L, len(heads), n_padded, BS, D]`, with the
        given source head for each output head, sharded by head on this mesh where possible."""
        ids = padded_block_ids(block_ids, self.block_buckets)
        self._count_shape(("read_blocks", len(ids), heads))
        tp = self.mesh.shape[AXIS]
        spec = P(None, AXIS) if len(heads) % tp == 0 else P()
        return gather_blocks(self.k_cache, self.v_cache, ids, heads, NamedSharding(self.mesh, spec))

    def write_blocks(self, block_ids: list[int], k: jax.Array | np.ndarray,
                     v: jax.Array | np.ndarray) -> None:
        """Write KV for these blocks: host arrays of exactly len(block_ids) blocks, or arrays
        already padded to the bucket (as `read_blocks` returns them)."""
        ids = padded_block_ids(block_ids, self.block_buckets)
        if isinstance(k, np.ndarray) and k.shape[2] == len(block_ids):
            k, v = pad_blocks(k, len(ids)), pad_blocks(v, len(ids))
        expected = (*self.k_cache.shape[:2], len(ids), *self.k_cache.shape[3:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(k.shape)} do not fit this cache: "
                             f"expected {expected}")
        self._count_shape(("write_blocks", len(ids)))
        self.k_cache, self.v_cache = scatter_blocks(self.k_cache, self.v_cache, ids, k, v)

    def warm_up_blocks(self, heads: tuple[int, ...] | None, write: bool) -> None:
        """Compile block reads (for destination layout `heads`) and/or writes, every bucket.
        Call before serving: the writes store zeros, which is what a fresh cache holds."""
        warmed, self.warmed_up = self.warmed_up, False  # these compilations are expected
        try:
            for n in self.block_buckets:
                ids = list(range(n))
                if heads is not None:
                    jax.block_until_ready(self.read_blocks(ids, heads))
                if write:
                    zeros = np.zeros((*self.k_cache.shape[:2], n, *self.k_cache.shape[3:]),
                                     self.k_cache.dtype)
                    self.write_blocks(ids, zeros, zeros)
            jax.block_until_ready(self.k_cache)
        finally:
            self.warmed_up = warmed

    def _count_shape(self, key: tuple[Any, ...], strict: bool = True) -> None:
        if key not in self.compiled_shapes:
            if strict and self.warmed_up and self.config.runner.strict_compile:
                raise UnexpectedCompilationError(f"shape {key} was not compiled at warm-up")
            self.compiled_shapes.add(key)
            self.num_compilations += 1

    # ---- warm-up -------------------------------------------------------------------------
    def warm_up(self) -> float:
        """Compile every program of `warm_up_programs` that was not loaded ready-made (from a
        compiled directory), by running it once on padding."""
        start = time.perf_counter()
        programs = [(arrays, sampling) for arrays, sampling in self.warm_up_programs()
                    if not self._loaded(arrays, sampling)]
        for arrays, sampling in tqdm(programs, desc="compiling", unit="program",
                                     disable=None if programs else True):
            jax.block_until_ready(self._run(arrays, sampling)[0])
        self.warmed_up = True
        return time.perf_counter() - start

    def warm_up_programs(self) -> list[tuple[StepArrays, SamplingMetadata]]:
        return planned_programs(self.model.cfg, self.plan)

    def _loaded(self, arrays: StepArrays, sampling: SamplingMetadata) -> bool:
        return (step_key(arrays) in self.executables
                and ("sample", pack(sampling)[1]) in self.executables)

    def compile_step(self, arrays: StepArrays) -> Any:
        """The model step for this bucket compiled (not run): what `jaxserve compile` saves."""
        inputs, layout = step_inputs(arrays)
        statics = self._statics(arrays)
        return model_step(statics).trace(statics, layout, *self._weights_and_caches(),
                                         self.prev, inputs).lower().compile()

    def compile_sampler(self, sampling: SamplingMetadata, logits: jax.ShapeDtypeStruct) -> Any:
        inputs, layout = pack(sampling)
        return _sample.trace(layout, logits, self.prev, sample_rows_shape(logits.shape[0]),
                             inputs).lower().compile()
