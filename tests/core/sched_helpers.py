"""A model-free harness for the scheduler: schedule, check invariants, feed fake sampled tokens."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from jaxserve.sampling_params import SamplingParams

BS = 4
EOS = 2
FIRST_SAMPLED = 1000  # fake sampled ids start here: never EOS, never a prompt token


def expected_outputs(n: int) -> list[int]:
    """The fake tokens a request gets when every update uses the default."""
    return [FIRST_SAMPLED + k for k in range(n)]


@dataclass(slots=True)
class StepRecord:
    out: SchedulerOutput
    # req_id -> (computed, num_tokens, num_outputs, placeholders) before the step
    before: dict[str, tuple[int, int, int, int]]
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    def is_decode(self, req_id: str) -> bool:
        """One token catching up the newest sampled token (maybe still in flight); anything
        else is a prefill chunk (a prompt chunk, or the recompute after a preemption)."""
        computed, num_tokens, num_outputs, placeholders = self.before[req_id]
        return (num_outputs + placeholders > 0 and computed == num_tokens + placeholders - 1
                and self.out.num_scheduled_tokens[req_id] == 1)

    @property
    def new_ids(self) -> list[str]:
        return [r.req_id for r in self.out.scheduled_new_reqs]


class WorkerView:
    """What a worker can rebuild from the SchedulerOutput diffs alone: each request's block
    table and computed count. The scheduler's own state must agree with it every step."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def apply(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.blocks.pop(rid, None)
            self.computed.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.blocks, f"{new.req_id} sent in full twice"
            req = requests[new.req_id]
            assert new.token_ids == req.all_token_ids
            assert new.num_output_tokens == req.num_output_tokens
            assert new.num_prompt_tokens == req.num_prompt_tokens
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, block_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            assert rid in self.blocks, f"diff for {rid}, which the worker does not hold"
            assert computed == self.computed[rid]
            self.blocks[rid].extend(block_ids)
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] += n


class Harness:
    def __init__(self, *, num_blocks: int = 64, block_size: int = BS, budget: int = 16,
                 max_num_seqs: int = 8, threshold: int = 0, chunked: bool = True,
                 policy: str = "fcfs", mixed: bool = True, caching: bool = True,
                 max_model_len: int = 4096, max_partial: int = 0,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 long_prefill_token_threshold=threshold,
                                 max_num_partial_prefills=max_partial,
                                 enable_chunked_prefill=chunked, scheduling_policy=policy,
                                 enable_mixed_batching=mixed,
                                 speculative_config=speculative_config)
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(config, cache, num_blocks, max_model_len, [EOS], hash_seed=0)
        self.kv = self.sched.kv
        self.config = config
        self.all: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.history: list[StepRecord] = []
        self.in_flight: StepRecord | None = None  # async scheduling: scheduled, not updated
        self.worker = WorkerView()
        self._clock = 0.0

    def add(self, rid: str, prompt: list[int] | int, *, max_tokens: int = 4,
            arrival: float | None = None, priority: int = 0, group_id: str | None = None,
            **params: object) -> Request:
        if isinstance(prompt, int):
            seed = zlib.crc32(rid.encode())  # distinct per id, stable across processes
            prompt = [10 + (seed + 37 * i) % 900 for i in range(prompt)]
        self._clock += 1.0
        req = Request(request_id=rid, prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                      arrival_time=self._clock if arrival is None else arrival,
                      block_size=self.kv.block_size, hash_seed=self.kv.root_hash,
                      priority=priority, max_tokens=max_tokens, group_id=group_id)
        self.sched.add_request(req)
        self.all[rid] = req
        return req

    def abort(self, *rids: str) -> None:
        self.sched.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)
        self.aborted.update(rids)

    def schedule(self) -> StepRecord:
        before = {rid: (r.num_computed_tokens, r.num_tokens, r.num_output_tokens,
                        r.num_output_placeholders) for rid, r in self.sched.requests.items()}
        record = StepRecord(self.sched.schedule(), before)
        check_step(self, record)
        self.worker.apply(record.out, self.sched.requests)
        for rid in record.out.num_scheduled_tokens:
            assert self.worker.blocks[rid] == self.blocks(rid)
            assert self.worker.computed[rid] == self.sched.requests[rid].num_computed_tokens
        self.history.append(record)
        return record

    def update(self, record: StepRecord, tokens: dict[str, int] | None = None) -> StepRecord:
        """Feed one sampled token per scheduled request (prefill chunks included, as the runner
        does); default: FIRST_SAMPLED + the request's output count."""
        tokens = tokens or {}
        ids = list(record.out.num_scheduled_tokens)
        sampled = [tokens.get(rid, FIRST_SAMPLED + self.all[rid].num_output_tokens) for rid in ids]
        record.outputs = self.sched.update_from_output(
            record.out, ModelRunnerOutput(ids, [[t] for t in sampled]))
        return record

    def step(self, tokens: dict[str, int] | None = None) -> StepRecord:
        return self.update(self.schedule(), tokens)

    def step_ahead(self) -> list[EngineCoreOutput]:
        """Async scheduling, as the engine core does it: schedule the next step, then update
        with the one in flight; returns that one's outputs."""
        previous, self.in_flight = self.in_flight, self.schedule()
        return self.update(previous).outputs if previous is not None else []

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: "
                             f"{sorted(self.sched.requests)}")

    def blocks(self, rid: str) -> list[int]:
        return self.kv.get_block_ids(rid)

    def assert_no_leaks(self) -> None:
        assert not self.sched.has_unfinished_requests()
        assert self.kv.num_free_blocks == self.kv.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)
        assert self.kv.req_to_blocks == {}


def check_step(h: Harness, record: StepRecord) -> None:
    """Invariants every SchedulerOutput must satisfy, whatever the workload."""
    out, sched, cfg = record.out, h.sched, h.config
    counts = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(counts.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert all(n >= 1 for n in counts.values())
    if cfg.long_prefill_token_threshold > 0:
        assert all(n <= cfg.long_prefill_token_threshold for n in counts.values())
    if cfg.max_num_partial_prefills > 0:
        assert sum(not record.is_decode(r) for r in counts) <= cfg.max_num_partial_prefills
    new_ids, cached_ids = record.new_ids, out.scheduled_cached_reqs.req_ids
    assert len(set(new_ids) | set(cached_ids)) == len(new_ids) + len(cached_ids)
    assert set(new_ids) | set(cached_ids) == set(counts)
    cached = out.scheduled_cached_reqs
    assert len(cached.new_block_ids) == len(cached.num_computed_tokens) == len(cached_ids)
    assert not out.preempted_req_ids & set(counts)
    if out.preempted_req_ids:
        assert new_ids == [], "a step that preempted admitted a waiting request"
    assert len(sched.running) <= cfg.max_num_seqs
    start = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    start.update(zip(cached_ids, cached.num_computed_tokens))
    for rid in counts:
        req = sched.requests[rid]
        assert req in sched.running
        if rid in cached_ids:
            assert start[rid] == record.before[rid][0]
        assert req.num_computed_tokens == start[rid] + counts[rid]
        # A sampling step reaches the end of the known tokens plus those in flight (drafts
        # counted as accepted), one of which it adds; the tokens in flight are at most this
        # step's and the previous one's.
        end = req.num_tokens + req.num_tokens_in_flight - (rid in out.sampling_req_ids)
        assert req.num_computed_tokens == end if rid in out.sampling_req_ids \
            else req.num_computed_tokens < end
        assert req.num_output_placeholders <= 2
    for req in sched.running:
        assert len(h.blocks(req.request_id)) >= -(-req.num_computed_tokens // h.kv.block_size)
    for req in sched.waiting:
        assert h.blocks(req.request_id) == []
    held = {b for rid in sched.requests for b in h.blocks(rid)}
    assert h.kv.num_free_blocks + len(held) == h.kv.num_blocks - 1
