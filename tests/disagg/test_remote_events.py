"""The decode EngineCore's side of the KV connector, driven by a scripted connector (no prefill
engine): what it does with first tokens that finish a request, a failed prefill step, and an
abort while the request waits, leaving nothing behind in the scheduler or the connector."""

from __future__ import annotations

import time
from typing import Any

from engine_helpers import SMALL_ENGINE
from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.core import EngineCore
from jaxserve.engine.kv_connector import KVConnector, TransferredKV


class ScriptedConnector(KVConnector):
    """First tokens come from `script`; KV never arrives; what is sent is recorded."""

    def __init__(self) -> None:
        super().__init__(heads=(0, 1))
        self.script: list[EngineCoreOutput] = []
        self.sent: list[str] = []
        self.aborted: list[str] = []
        self._root = b""

    @property
    def root_hash(self) -> bytes:
        return self._root

    def bind(self, executor: Any, root_hash: bytes, warm: bool) -> float:
        self._root = root_hash
        return super().bind(executor, root_hash, warm)

    def _send_request(self, fields: dict[str, Any]) -> None:
        self.sent.append(fields["request_id"])

    def _send_abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def _pull(self, request_id: str, rank: int, first_block: int, num_blocks: int) -> None:
        return None

    def _receive(self, idle: bool) -> tuple[list[EngineCoreOutput], list[TransferredKV]]:
        out, self.script = self.script, []
        return out, []

    def prefill_stats(self) -> Any:
        return None


def _request(core: EngineCore, rid: str, max_tokens: int = 4) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(3, 40)),
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   arrival_time=time.time(), block_size=16, hash_seed=core.root_hash,
                   max_tokens=max_tokens)


def test_finished_failed_and_aborted_remote_requests_leave_nothing_behind(hf_checkpoint):
    connector = ScriptedConnector()
    config = EngineConfig.from_kwargs(model=str(hf_checkpoint("llama")), **SMALL_ENGINE)
    core = EngineCore(config, connector=connector)
    eos = core.model_config.eos_token_ids[0]
    for rid in ("eos", "one", "failed", "aborted", "moving"):
        core.add_request(_request(core, rid, max_tokens=1 if rid == "one" else 4))
    assert connector.sent == ["eos", "one", "failed", "aborted", "moving"]
    assert core.step() == []  # nothing from the prefill side yet: nothing runs here
    connector.script = [EngineCoreOutput("eos", [eos]), EngineCoreOutput("one", [7]),
                        EngineCoreOutput("failed", [], finish_reason="error", error="boom"),
                        EngineCoreOutput("moving", [7])]
    outs = {o.request_id: o for o in core.step()}
    assert (outs["eos"].finish_reason, outs["one"].finish_reason) == ("stop", "length")
    assert outs["failed"].finish_reason == "error" and outs["failed"].error == "boom"
    assert "moving" in connector.transferring  # its blocks taken, its KV on the way
    assert set(connector.aborted) == {"eos", "one", "failed"}  # the prefill side frees them
    core.abort_requests(["aborted", "moving"])  # one still prefilling, one with KV on the way
    assert "aborted" in connector.aborted
    assert not (connector.prefilling or connector.parked or connector.transferring)
    scheduler = core.schedulers[0]
    assert not scheduler.requests and not scheduler.kv.req_to_blocks
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks - 1
    assert not core.has_unfinished_requests() and (core.router is None or not core.router.routes)
    assert scheduler.stats().num_waiting == 0
