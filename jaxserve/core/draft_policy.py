"""Which decoding requests get drafts in a step, and how many (speculative decoding, no jax).

A request drafts unless speculation is off (by the engine's switch, or at this batch size), its
tokens are bound to its host history (penalties, a grammar) or to its exact output count
(min_tokens still holding back its stop tokens), or it is backing off: after each verification
that accepted nothing it drafts no more for 2, then MAX_BACKOFF steps, so a request whose drafts
never hit pays for them in one step of five (and the engine's switch turns drafting off where
it measures slower). A request running alone does not back off: its step costs about the same
with drafts (the fixed cost of a step; on TPU/GPU the weights' reads), so a miss costs little
and a skipped step could have been a hit (stories260K's retelling, batch 1, n-gram drafts:
1.35x the tokens/s of no speculation with the backoff, 1.65x without, in one run each).

Drafts are proposed by the step on the device (programs/device_drafts.py): the scheduler only
gives a request its draft slots, -1 each. So a step scheduled while the one before it still
runs (async scheduling) drafts from the tokens that step really accepted.
"""

from __future__ import annotations

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import SpecDecodingStats

# Steps. Short: where first drafts are accepted about half the time, misses come in runs and a
# long backoff skips the hits after them (stories260K's retelling, drafts then made on the host:
# a cap of 64 left 24% of steps drafting and 1.41 tokens a step, a cap of 4 31% and 1.71, +15%
# tokens/s); where drafts never hit, the engine's switch still turns drafting off.
MAX_BACKOFF = 4


class DraftPolicy:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int):
        self.spec = spec
        self.max_model_len = max_model_len
        self.enabled = True  # the engine's switch (off while drafting measures slower)
        self.stats = SpecDecodingStats()

    def may_draft(self, request: Request, num_running: int, step: int) -> bool:
        spec = self.spec
        params = request.sampling_params
        return (self.enabled and (request.drafts_resume_step <= step or num_running == 1)
                and not params.needs_host_history
                and request.num_output_tokens >= params.min_tokens
                and not 0 < spec.disable_by_batch_size <= num_running)

    def drafts(self, request: Request, budget: int, num_running: int, step: int) -> list[int]:
        """This step's draft slots (-1 each: the step proposes the drafts): none unless
        `may_draft`, or past max_tokens, max_model_len or the budget (tokens in flight counted as
        if all were accepted)."""
        if not self.may_draft(request, num_running, step):
            return []
        in_flight = request.num_tokens_in_flight
        k = min(self.spec.num_speculative_tokens, budget,
                request.max_tokens - request.num_output_tokens - in_flight - 1,
                self.max_model_len - request.num_tokens - in_flight)
        return [-1] * max(k, 0)

    def record(self, request: Request, num_drafted: int, num_accepted: int, step: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        if num_accepted:
            request.draft_misses = 0
            return
        request.draft_misses += 1
        request.drafts_resume_step = step + min(2 ** request.draft_misses, MAX_BACKOFF)
