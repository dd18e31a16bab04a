"""The `disaggregation` argument and the host-side hooks it needs (no jax, no engine)."""

from __future__ import annotations

import json

import pytest

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig, side_config
from jaxserve.config.disaggregation import DisaggregationSide
from jaxserve.core.request import KVTransfer, Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_kv_connector import KVConsumer, KVProducer
from jaxserve.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput
from jaxserve.sampling_params import SamplingParams


def _config(**kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(model="dummy", **kwargs)  # no model files are read


SPLIT = {"prefill": {"num_devices": 4},
         "decode": {"num_devices": 4, "tensor_parallel_size": 2, "data_parallel_size_local": 2,
                    "max_num_seqs": 8}}


def test_device_counts_are_assigned_without_overlap_and_parallel_sizes_filled_in():
    d = _config(disaggregation=SPLIT).parallel.disaggregation
    assert d.prefill == DisaggregationSide([0, 1, 2, 3], 4, 1)
    assert d.decode == DisaggregationSide([4, 5, 6, 7], 2, 2, {"max_num_seqs": 8})
    assert (d.connector, d.kv_transport, d.max_pending_transfers) == ("inprocess", "auto", 64)


def test_explicit_devices_are_kept_and_the_other_side_takes_the_lowest_free_ones():
    d = _config(disaggregation={
        "prefill": {"devices": [0, 2]}, "decode": {"num_devices": 3}}).parallel.disaggregation
    assert d.prefill.devices == [0, 2] and d.decode.devices == [1, 3, 4]


def test_two_processes_number_their_devices_from_zero_each():
    d = _config(disaggregation={
        "connector": "socket", "prefill": {"num_devices": 2, "env": {"A": "1"}},
        "decode": {"num_devices": 2}}).parallel.disaggregation
    assert d.prefill.devices == d.decode.devices == [0, 1]
    assert d.prefill.env == {"A": "1"} and d.to_dict()["prefill"]["env"] == {"A": "1"}


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
    ({"connector": "socket", "kv_transport": "rdma"}, "disaggregation.kv_transport must be"),
    ({"kv_transport": "bytes"}, "kv_transport applies to the socket connector only"),
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


# ---- the scheduler's hooks: receive before schedule, send after the first token -----------
BS = 4


def _scheduler(num_blocks: int = 12, max_num_seqs: int = 4, max_sending: int | None = None,
               mixed: bool = True) -> Scheduler:
    """A decode side's scheduler (a KVConsumer), or with `max_sending` a prefill side's."""
    connector = KVConsumer() if max_sending is None else KVProducer(max_sending)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                     enable_mixed_batching=mixed),
                     CacheConfig(block_size=BS), num_blocks, 64, [1], hash_seed=0,
                     connector=connector)


def _request(s: Scheduler, rid: str, prompt: list[int], role: KVTransfer | None = None,
             max_tokens: int = 8) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   arrival_time=0.0, block_size=BS, hash_seed=s.kv.root_hash,
                   max_tokens=max_tokens, kv_transfer=role)


def _first_token(s: Scheduler, rid: str, token: int = 7, cached: int = 0) -> EngineCoreOutput:
    out = s.accept_remote_token(EngineCoreOutput(rid, [token], num_cached_tokens=cached))
    assert out is not None
    return out


def test_a_received_request_waits_for_its_first_token_then_its_kv_then_runs_like_a_hit():
    s = _scheduler()
    r = _request(s, "t", list(range(10)), KVTransfer.RECEIVE)
    s.add_request(r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = s.schedule()  # no first token yet: nothing happens
    assert out.is_empty and not out.kv_loads and not s.kv.req_to_blocks
    assert _first_token(s, "t", cached=4).finish_reason is None and r.output_token_ids == [7]
    out = s.schedule()  # blocks for the prompt + the first token; the prompt's are loaded
    assert out.is_empty and [(x.req_id, x.first_block) for x in out.kv_loads] == [("t", 0)]
    held = s.kv.get_block_ids("t")
    assert len(held) == 3 and out.kv_loads[0].block_ids == held  # 11 tokens; 10 moved
    assert s.schedule().is_empty  # the KV is on its way
    s.connector.finish_loading("t")
    out = s.schedule()
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.num_computed_tokens, new.block_ids) == ("t", 10, held)
    assert new.num_output_tokens == 1 and out.num_scheduled_tokens == {"t": 1}
    outputs = s.update_from_output(out, ModelRunnerOutput(["t"], [[9]]))
    assert outputs[0].new_token_ids == [9] and r.output_token_ids == [7, 9]
    assert outputs[0].num_cached_tokens == 4  # the prefill side's hit, reported as vLLM's
    assert s.kv.num_cached_blocks["t"] == 2  # the moved full blocks are hittable now
    s.finish_requests(["t"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 11


def test_without_mixed_batching_remote_requests_neither_stall_decodes_nor_wait_forever():
    s = _scheduler(mixed=False)
    s.add_request(_request(s, "d", list(range(5))))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["d"], [[3]]))  # "d" decodes from now on
    s.add_request(_request(s, "t", list(range(10)), KVTransfer.RECEIVE))
    assert s.schedule().num_scheduled_tokens == {"d": 1}  # t has no first token: decode on
    _first_token(s, "t")
    out = s.schedule()  # a prefill-phase step: t takes its blocks, its KV is to be loaded
    assert [x.req_id for x in out.kv_loads] == ["t"]
    assert s.schedule().num_scheduled_tokens == {"d": 1}  # t's KV on the way: decode on
    s.connector.finish_loading("t")
    assert s.schedule().num_scheduled_tokens == {"t": 1}  # t admitted (all prefill, as V0)


def test_a_first_token_that_finishes_the_request_frees_it_without_blocks():
    s = _scheduler()
    s.add_request(_request(s, "eos", list(range(6)), KVTransfer.RECEIVE))
    s.add_request(_request(s, "one", list(range(6)), KVTransfer.RECEIVE, max_tokens=1))
    assert _first_token(s, "eos", token=1).finish_reason == "stop"  # 1 is the eos id
    assert _first_token(s, "one").finish_reason == "length"
    assert not s.has_unfinished_requests() and not s.kv.req_to_blocks
    assert s.accept_remote_token(EngineCoreOutput("eos", [3])) is None  # gone: ignored


def test_decode_prefix_hits_cut_what_is_moved():
    s = _scheduler()
    s.add_request(_request(s, "a", list(range(10)), KVTransfer.RECEIVE))
    _first_token(s, "a")
    s.schedule()
    s.connector.finish_loading("a")
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[9]]))  # a's full blocks now cached
    s.add_request(_request(s, "b", list(range(9)) + [50], KVTransfer.RECEIVE))
    _first_token(s, "b")
    out = s.schedule()
    load = next(x for x in out.kv_loads if x.req_id == "b")
    assert load.first_block == 2  # tokens 0-7 hit here: only block 2 (tokens 8, 9) moves
    assert load.block_ids == s.kv.get_block_ids("b")[2:3]


def test_loads_respect_max_num_seqs_and_the_pool_and_aborts_free_cleanly():
    s = _scheduler(num_blocks=6, max_num_seqs=2)  # 5 usable blocks
    a, b, c = (_request(s, x, list(range(7)), KVTransfer.RECEIVE) for x in "abc")
    for r in (a, b, c):
        s.add_request(r)
        _first_token(s, r.request_id)
    out = s.schedule()
    assert [x.req_id for x in out.kv_loads] == ["a", "b"]  # max_num_seqs: c waits
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # aborted with its KV on the way
    s.connector.finish_loading("b")  # its late arrival changes nothing
    big = _request(s, "big", list(range(20)), KVTransfer.RECEIVE)
    s.add_request(big)
    _first_token(s, "big")
    out = s.schedule()
    assert [x.req_id for x in out.kv_loads] == ["c"]  # big needs 6 blocks > 3 free: it waits
    for rid in ("a", "c", "big"):
        s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 5 and not s.kv.req_to_blocks and not s.has_unfinished_requests()


def test_a_sent_request_keeps_its_blocks_until_released_and_caps_admission():
    s = _scheduler(max_sending=1)
    p = _request(s, "p", list(range(9)), KVTransfer.SEND, max_tokens=1)
    q = _request(s, "q", list(range(20, 29)), KVTransfer.SEND, max_tokens=1)
    s.add_request(p)
    out = s.schedule()
    assert s.update_from_output(out, ModelRunnerOutput(["p"], [[5]]))[0].finish_reason == "length"
    blocks = s.kv.get_block_ids("p")
    assert len(blocks) == 3 and s.connector.sending == {"p": p}
    assert not s.has_unfinished_requests()
    assert "p" in s.schedule().finished_req_ids  # the worker drops its state
    s.add_request(q)
    assert s.schedule().is_empty  # one request's blocks wait to be read: admit nothing
    s.connector.release("p")
    assert not s.connector.sending and s.kv.num_free_blocks == 11  # freed (and still cached)
    assert "q" in s.schedule().num_scheduled_tokens
    again = _request(s, "r", list(range(9)))  # the released prompt stays in the prefix cache
    assert s.kv.get_computed_blocks(again)[1] == 8


def test_an_aborted_sent_request_frees_its_blocks_at_once():
    s = _scheduler(max_sending=0)
    s.add_request(_request(s, "p", list(range(9)), KVTransfer.SEND, max_tokens=1))
    s.schedule()
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert not s.connector.sending and s.kv.num_free_blocks == 11


def test_a_preempted_received_request_resumes_from_its_moved_blocks_in_the_cache():
    s = _scheduler(num_blocks=7, max_num_seqs=4)  # 6 usable blocks of 4 tokens
    a = _request(s, "a", list(range(7)), KVTransfer.RECEIVE)
    b = _request(s, "b", list(range(10, 17)), KVTransfer.RECEIVE)
    for r in (a, b):
        s.add_request(r)
        _first_token(s, r.request_id, token=2)
    for load in s.schedule().kv_loads:  # 8 tokens: 2 blocks each
        s.connector.finish_loading(load.req_id)
    preempted: set[str] = set()
    for _ in range(6):  # both grow until the pool runs dry and the newest is preempted
        out = s.schedule()
        preempted |= out.preempted_req_ids
        s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens),
                                                    [[2]] * len(out.num_scheduled_tokens)))
        if preempted:
            break
    assert preempted == {"b"} and b in s.waiting and b.num_computed_tokens == 0
    assert b.status == RequestStatus.PREEMPTED  # recomputed here, not received again
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    resumed = {n.req_id: n for n in out.scheduled_new_reqs}["b"]
    # The two moved full blocks were cached after the first decode step: a hit now.
    assert resumed.num_computed_tokens == 8
    assert resumed.token_ids == b.all_token_ids and resumed.num_output_tokens == b.num_output_tokens
