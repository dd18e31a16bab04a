"""The scheduler's side of disaggregated prefill/decode (engine/disagg/ moves the KV).

Prefill side: a finished request marked KVTransfer.SEND keeps its blocks in `sending` until the
decode side has read them. Decode side: a KVTransfer.RECEIVE request waits, then takes blocks
for its prompt when its first token arrives (`_holding`); the prompt blocks its prefix cache
lacks become a KVLoad of the next step, and `finish_loading` admits it like a prefix hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import EngineCoreOutput, KVLoad, Logprobs, PromptLogprobs


class RemoteKVScheduling:
    """Mixed into Scheduler, which owns this state."""
    kv: KVCacheManager
    requests: dict[str, Request]
    sending: dict[str, Request]
    _holding: set[str]
    _loads: list[KVLoad]

    if TYPE_CHECKING:
        def _append_tokens(self, request: Request, tokens: list[int],
                           logprobs: list[Logprobs] | None,
                           prompt_logprobs: PromptLogprobs | None = None) -> EngineCoreOutput: ...

    def _waits_on_remote(self, request: Request) -> bool:
        """Decode side: no first token yet, or its KV on the way: nothing to do for it now."""
        return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and (
            not request.num_output_tokens or request.request_id in self._holding)

    def _allocate_for_load(self, request: Request) -> bool:
        """Decode side: blocks for a request whose first token came from the prefill side
        (prompt + that token), hitting this side's prefix cache first; the prompt blocks past
        the hit become a KVLoad of this step. False, with nothing changed, when the pool is
        full (the lookup counts in the stats once it succeeds: it is retried every step)."""
        hits, num_hit = self.kv.find_cached_prefix(request)
        if self.kv.allocate_slots(request, request.num_tokens - num_hit, hits) is None:
            return False
        self.kv.record_query(request, num_hit)
        self._holding.add(request.request_id)
        request.num_computed_tokens = num_hit
        # The prompt past the hit (the first token's KV is computed here: the next input).
        first, block_ids = self.kv.get_block_span(request.request_id, num_hit,
                                                  request.num_tokens - 1)
        if block_ids:
            self._loads.append(KVLoad(request.request_id, block_ids, first))
        else:  # the whole prompt was a hit here: nothing to move
            self.finish_loading(request.request_id)
        return True

    def finish_loading(self, request_id: str) -> None:
        """Decode side: a request's prompt KV is in its blocks (or its write is dispatched
        ahead of the next step): it is admitted like a prefix hit of all but its last token."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return  # aborted while its KV was on the way
        request.status = RequestStatus.WAITING
        request.kv_transfer = None
        request.num_computed_tokens = request.num_tokens - 1

    def accept_remote_token(self, output: EngineCoreOutput) -> EngineCoreOutput | None:
        """Decode side: the first token, sampled by the prefill side, applied as if sampled here
        (stop checks included). None when the request is gone (aborted meanwhile)."""
        request = self.requests.get(output.request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS \
                or request.num_output_tokens:
            return None
        request.num_cached_tokens = output.num_cached_tokens
        logprobs = output.new_logprobs[0] if output.new_logprobs else None
        return self._append_tokens(request, output.new_token_ids[:1],
                                   None if logprobs is None else [logprobs],
                                   output.prompt_logprobs)

    def release_sent(self, request_id: str) -> None:
        """Prefill side: free a finished request's blocks once read (or no longer wanted); they
        stay in the prefix cache."""
        request = self.sending.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
