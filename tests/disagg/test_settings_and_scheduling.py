"""The `disaggregation` argument and the host-side hooks it needs (no jax, no engine)."""

from __future__ import annotations

import json

import pytest

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import ModelRunnerOutput
from jaxserve.disaggregation_config import side_config
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

def _config(**kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(model="dummy", **kwargs)  # no model files are read


SPLIT = {"prefill": {"num_devices": 4},
         "decode": {"num_devices": 4, "tensor_parallel_size": 2, "data_parallel_size_local": 2,
                    "max_num_seqs": 8}}


def test_device_counts_are_assigned_without_overlap_and_parallel_sizes_filled_in():
    d = _config(disaggregation=SPLIT).parallel.disaggregation
    assert d["prefill"] == {"devices": [0, 1, 2, 3], "tensor_parallel_size": 4,
                            "data_parallel_size_local": 1}
    assert d["decode"]["devices"] == [4, 5, 6, 7]
    assert (d["decode"]["tensor_parallel_size"], d["decode"]["data_parallel_size_local"]) == (2, 2)
    assert d["connector"] == "inprocess"


def test_explicit_devices_are_kept_and_the_other_side_takes_the_lowest_free_ones():
    d = _config(disaggregation={
        "prefill": {"devices": [0, 2]}, "decode": {"num_devices": 3}}).parallel.disaggregation
    assert d["prefill"]["devices"] == [0, 2] and d["decode"]["devices"] == [1, 3, 4]


def test_two_processes_number_their_devices_from_zero_each():
    d = _config(disaggregation={
        "connector": "socket", "prefill": {"num_devices": 2, "env": {"A": "1"}},
        "decode": {"num_devices": 2}}).parallel.disaggregation
    assert d["prefill"]["devices"] == d["decode"]["devices"] == [0, 1]
    assert d["prefill"]["env"] == {"A": "1"}


def test_normal_form_is_stable_through_replace_and_json_text(tmp_path):
    config = _config(disaggregation=SPLIT)
    again = config.replace(max_num_seqs=4).parallel.disaggregation
    assert again == config.parallel.disaggregation
    from_text = _config(disaggregation=json.dumps(SPLIT))
    assert from_text.parallel.disaggregation == config.parallel.disaggregation
    path = tmp_path / "split.yaml"
    path.write_text("prefill: {num_devices: 4}\ndecode: {num_devices: 4, "
                    "tensor_parallel_size: 2, data_parallel_size_local: 2, max_num_seqs: 8}\n")
    assert _config(disaggregation=str(path)).parallel.disaggregation == \
        config.parallel.disaggregation


def test_side_config_applies_the_side_arguments_and_keeps_the_shared_ones():
    config = _config(block_size=8, max_model_len=64,
                                      disaggregation=SPLIT)
    decode = side_config(config, config.parallel.disaggregation, "decode")
    assert decode.parallel.disaggregation is None
    assert decode.parallel.devices == [4, 5, 6, 7]
    assert decode.scheduler.max_num_seqs == 8 and config.scheduler.max_num_seqs == 64
    assert (decode.cache.block_size, decode.model.max_model_len) == (8, 64)


@pytest.mark.parametrize("value,message", [
    ({"bogus": 1}, "disaggregation: unknown key 'bogus'"),
    ({"decode": {"model": "x"}}, "disaggregation.decode: unknown key 'model'"),
    ({"decode": {"env": {}}}, "disaggregation.decode: unknown key 'env'"),
    ({"prefill": {"devices": [0, 1]}, "decode": {"devices": [1, 2]}},
     "prefill devices \\[0, 1\\] and decode devices \\[1, 2\\] overlap"),
    ({"prefill": {"num_devices": 4, "tensor_parallel_size": 3}},
     "tensor_parallel_size 3 x data_parallel_size_local 1 = 3 must equal"),
    ({"prefill": {"devices": [0, 0]}}, "disaggregation.prefill.devices must be"),
    ({"prefill": {"devices": [0, 1], "num_devices": 3}}, "num_devices 3 != len"),
    ({"connector": "rdma"}, "disaggregation.connector must be one of"),
    ({"decode": {"max_num_seqs": 0}}, "disaggregation.decode: max_num_seqs must be"),
    ({"max_pending_transfers": 0}, "max_pending_transfers must be an integer >= 1"),
    ("[1, 2", "not valid JSON/YAML"),
    (["prefill"], "disaggregation must be a mapping"),
])
def test_bad_disaggregation_settings_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        _config(disaggregation=value)


def test_disaggregation_rejects_engine_wide_devices_and_multi_host():
    with pytest.raises(ValueError, match="give devices per side"):
        _config(devices=[0], disaggregation={})
    with pytest.raises(ValueError, match="multi-host"):
        _config(coordinator_address="127.0.0.1:1", disaggregation={})
    with pytest.raises(ValueError, match="devices must be a non-empty list"):
        _config(devices=[1, 1])


# ---- scheduler and KV-cache-manager hooks ----------------------------------------------------
BS = 4


def _scheduler(num_blocks: int = 12, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                     CacheConfig(block_size=BS), num_blocks, 64, [1], hash_seed=0)


def _request(s: Scheduler, rid: str, prompt: list[int], outputs: list[int] = ()) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
                   arrival_time=0.0, block_size=BS, hash_seed=s.kv.root_hash,
                   output_token_ids=list(outputs), max_tokens=8)


def test_allocate_external_takes_blocks_for_the_external_and_new_tokens_or_nothing():
    mgr = KVCacheManager(5, BS)  # 4 usable blocks
    a = Request(request_id="a", prompt_token_ids=list(range(8)), sampling_params=None,
                arrival_time=0.0, block_size=BS, hash_seed=mgr.root_hash)
    assert mgr.allocate_external(a, 8, 1) == [1, 2, 3]  # 9 tokens -> 3 blocks
    b = Request(request_id="b", prompt_token_ids=list(range(8)), sampling_params=None,
                arrival_time=0.0, block_size=BS, hash_seed=mgr.root_hash)
    assert mgr.allocate_external(b, 8, 0) is None  # 2 needed, 1 free: nothing changes
    assert mgr.num_free_blocks == 1 and "b" not in mgr.req_to_blocks
    with pytest.raises(ValueError, match="already holds blocks"):
        mgr.allocate_external(a, 8, 1)
    mgr.free(a)
    assert mgr.num_free_blocks == 4


def test_a_transferred_request_runs_on_from_its_last_token_like_a_prefix_hit():
    s = _scheduler()
    r = _request(s, "t", list(range(10)), outputs=[7])  # prompt KV transferred, 1 token out
    block_ids = s.reserve_transfer(r)
    assert block_ids is not None and len(block_ids) == 3  # 11 tokens
    assert s.num_reserved == 1 and not s.running
    s.admit_transferred("t")
    out = s.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["t"]
    new = out.scheduled_new_reqs[0]
    assert (new.num_computed_tokens, new.block_ids, new.num_output_tokens) == (10, block_ids, 1)
    assert out.num_scheduled_tokens == {"t": 1}  # only the first output token's KV
    outputs = s.update_from_output(out, ModelRunnerOutput(["t"], [9]))
    assert outputs[0].new_token_ids == [9] and r.output_token_ids == [7, 9]
    assert s.kv.num_cached_blocks["t"] == 2  # the transferred full blocks are hittable now
    s.finish_requests(["t"], r.status.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 11


def test_reservations_respect_max_num_seqs_and_the_pool_and_cancel_cleanly():
    s = _scheduler(num_blocks=6, max_num_seqs=2)  # 5 usable blocks
    a, b, c = (_request(s, x, list(range(7)), [1]) for x in "abc")  # 2 blocks each
    assert s.reserve_transfer(a) is not None and s.reserve_transfer(b) is not None
    assert s.reserve_transfer(c) is None  # max_num_seqs
    assert s.cancel_reservation("b") and not s.cancel_reservation("b")
    big = _request(s, "big", list(range(20)), [1])  # 6 blocks > 3 free
    assert s.reserve_transfer(big) is None and s.kv.num_free_blocks == 3
    with pytest.raises(ValueError, match="already in this scheduler"):
        s.reserve_transfer(a)
    s.cancel_reservation("a")
    assert s.kv.num_free_blocks == 5 and not s.kv.req_to_blocks


def test_an_admitted_request_aborted_before_scheduling_never_reaches_the_worker():
    s = _scheduler()
    r = _request(s, "t", list(range(6)), [3])
    s.reserve_transfer(r)
    s.admit_transferred("t")
    s.finish_requests(["t"], r.status.FINISHED_ABORTED)
    out = s.schedule()
    assert not out.scheduled_new_reqs and out.finished_req_ids == {"t"}
    assert s.kv.num_free_blocks == 11


def test_detach_keeps_the_blocks_until_released_and_tells_the_worker_to_drop_it():
    s = _scheduler()
    r = _request(s, "p", list(range(9)))
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["p"], [5]))
    blocks = s.kv.get_block_ids("p")
    detached = s.detach_request("p")
    assert detached is r and not s.running and not s.has_unfinished_requests()
    assert s.kv.get_block_ids("p") == blocks and len(blocks) == 3
    assert "p" in s.schedule().finished_req_ids
    s.kv.free(detached)
    assert s.kv.num_free_blocks == 11
    again = _request(s, "q", list(range(9)))  # the released prompt stays in the prefix cache
    assert s.kv.get_computed_blocks(again)[1] == 8


def test_a_preempted_transferred_request_resumes_from_its_transferred_blocks_in_the_cache():
    s = _scheduler(num_blocks=7, max_num_seqs=4)  # 6 usable blocks of 4 tokens
    a, b = _request(s, "a", list(range(7)), [1]), _request(s, "b", list(range(10, 17)), [1])
    for r in (a, b):
        s.reserve_transfer(r)  # 8 tokens: 2 blocks each
        s.admit_transferred(r.request_id)
    preempted: set[str] = set()
    for step in range(6):  # both grow until the pool runs dry and the newest is preempted
        out = s.schedule()
        preempted |= out.preempted_req_ids
        s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens),
                                                    [2] * len(out.num_scheduled_tokens)))
        if preempted:
            break
    assert preempted == {"b"} and b in s.waiting and b.num_computed_tokens == 0
    s.finish_requests(["a"], a.status.FINISHED_ABORTED)
    out = s.schedule()
    resumed = {n.req_id: n for n in out.scheduled_new_reqs}["b"]
    # The two transferred full blocks were cached after the first decode step: a hit now.
    assert resumed.num_computed_tokens == 8
    assert resumed.token_ids == b.all_token_ids and resumed.num_output_tokens == b.num_output_tokens
