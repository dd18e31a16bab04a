"""Shared settings and checks for the disaggregated-engine tests."""

from __future__ import annotations

import time

from engine_helpers import random_prompts

from jaxserve import SamplingParams
from jaxserve.core.scheduler_kv_connector import KVProducer
from jaxserve.engine.disagg.connector import InProcessConnector

# Few step shapes (each costs seconds to compile): one token bucket, one request bucket.
ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=16, max_num_seqs=16,
              max_num_batched_tokens=64, token_buckets=[64], request_buckets=[16])
# Prefill on 4 devices with TP 4 (4 duplicated copies of the 2 KV heads), decode on the other
# 4 with TP 2 x DP 2; at most 4 requests per decode rank, so a burst parks (back-pressure).
SPLIT = {"prefill": {"num_devices": 4, "long_prefill_token_threshold": 32},
         "decode": {"num_devices": 4, "tensor_parallel_size": 2, "data_parallel_size_local": 2,
                    "max_num_seqs": 4}}
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompts: short and long, a family sharing a 40-token prefix, two seeded sampled
    requests (one with n = 2) and one whose first token is its last."""
    prefix = random_prompts(1, 40, 40, seed=90)[0]
    prompts = random_prompts(8, 1, 100, seed=91)
    prompts += [prefix + tail for tail in random_prompts(3, 1, 20, seed=92)]
    prompts += random_prompts(3, 10, 60, seed=93)
    params = [GREEDY] * 11 + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    return prompts, params


def prefix_prompt() -> list[int]:
    return random_prompts(1, 40, 40, seed=90)[0] + [3]


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_no_disagg_leaks(engine) -> None:
    """Nothing left in flight, and every block free on both sides."""
    core = engine.core
    connector = core.connector
    assert not connector.prefilling and not connector.parked and not connector.transferring
    sides = [core]
    if isinstance(connector, InProcessConnector):
        state = connector.prefill.state()
        sides.append(connector.prefill.core)
    else:  # the prefill process reports its state after every message sent before
        state = connector.state()
    assert state["num_holding"] == 0 and state["num_requests"] == 0
    assert state["num_block_owners"] == 0
    assert state["num_free_blocks"] == [n - 1 for n in state["num_blocks"]]
    for side in sides:
        for sched in side.schedulers:
            assert not sched.running and not sched.waiting and not sched.requests
            producer = sched.connector if isinstance(sched.connector, KVProducer) else None
            assert not (producer and producer.sending) and not sched.kv.req_to_blocks
            assert sched.kv.num_free_blocks == sched.kv.num_blocks - 1
        assert side.router is None or (not side.router.routes and not side.router.groups)
    assert not engine.output_processor.states


def drain(engine, finished: dict, timeout_s: float = 600.0) -> None:
    """Step until nothing is left, recording finished outputs by request id."""
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
