"""The cross-process connector: the prefill engine in a child process (TP 4 on its own 4 CPU
devices), this process decoding (TP 2 x DP 2), KV through JAX's transfer server or as bytes
over loopback on a free port. Same tokens as the unified engine, async scheduling on both
sides, aborts in flight, no leaked block on either side."""

from __future__ import annotations

import socket

import jax
import pytest
from disagg_helpers import (ENGINE, GREEDY, SPLIT, assert_no_disagg_leaks, drain, prefix_prompt,
                            tokens, workload)

from jaxserve import LLMEngine
from jaxserve.config import EngineConfig
from jaxserve.engine.disagg.socket_connector import PrefillProcessError, SocketConnector

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (forced) CPU devices")
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _socket_split(**extra: object) -> dict:
    # Decode on this process's devices 4-7 (as in the in-process tests: compiled steps are
    # shared); the child numbers its own 4 devices from 0.
    return SPLIT | {"connector": "socket", "port": _free_port(), "startup_timeout_s": TIMEOUT_S,
                    "decode": SPLIT["decode"] | {"devices": [4, 5, 6, 7]}} | extra


@pytest.mark.slow
@pytest.mark.parametrize("kv_transport", ["jax_transfer", "bytes"])
def test_two_processes_give_the_unified_tokens_and_leak_nothing(gqa8, compile_cache_dir,
                                                                reference, kv_transport):
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=gqa8, compilation_cache_dir=compile_cache_dir,
        disaggregation=_socket_split(kv_transport=kv_transport), **ENGINE))
    connector = engine.core.connector
    assert isinstance(connector, SocketConnector) and connector.kv_transport == kv_transport
    try:
        finished: dict = {}
        engine.add_request("warm", {"prompt_token_ids": prefix_prompt()}, GREEDY)
        drain(engine, finished, TIMEOUT_S)
        prompts, params = workload()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        engine.add_request("cut", {"prompt_token_ids": prompts[1]}, GREEDY)
        cut_state = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                elif out.request_id == "cut" and cut_state is None:
                    # the first token is out: the KV is parked or moving
                    cut_state = ("parked" if "cut" in connector.parked
                                 else "transferring" if "cut" in connector.transferring
                                 else "decode")
                    engine.abort_request("cut")
        assert cut_state is not None and "cut" not in finished
        assert [tokens(finished[f"r{i}"]) for i in range(len(prompts))] == reference
        assert_no_disagg_leaks(engine)
        kv = engine.stats().kv_transfer
        assert kv.prefill.prefix_cache_hits >= 3 * 32  # counted in the prefill process
        assert kv.num_transfers >= len(prompts) - 1 and kv.transfer_bytes > 0
        assert kv.transfer_seconds > 0
    finally:
        engine.core.close()
    assert connector.process.poll() is not None  # the prefill process is gone


def test_a_prefill_process_that_fails_to_start_is_reported_with_its_log(gqa8, tmp_path):
    bad = _socket_split(prefill={"num_devices": 4, "env": {"JAX_PLATFORMS": "no-such-platform"}})
    with pytest.raises(PrefillProcessError, match="prefill process"):
        LLMEngine(EngineConfig.from_kwargs(model=gqa8, disaggregation=bad, **ENGINE))
