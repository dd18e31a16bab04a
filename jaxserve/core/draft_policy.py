"""Which decoding requests get drafts in a step, and how many (speculative decoding, no jax).

A request drafts unless speculation is off (by the engine's switch, or at this batch size), its
tokens are bound to its host history (penalties, a grammar) or to its exact output count
(min_tokens still holding back its stop tokens), or it is backing off: after each verification
that accepted nothing it drafts no more for 2, then MAX_BACKOFF steps, so a request whose drafts
never hit pays for them in one step of five (and the engine's switch turns drafting off where
it measures slower).

With async scheduling a request drafts while its previous step still runs: its drafts continue
the sequence as if that step accepted every draft it carries (and, for n-gram lookup, as if it
samples what the lookup proposes first); the step corrects its positions on the device when
fewer were accepted, and its drafts are then merely unlikely to be accepted. So the engine runs
ahead of a drafting step only while its requests' last verifications accepted every draft
(`Scheduler.waits_on_drafts`): after a miss, the next drafts follow the real tokens.
"""

from __future__ import annotations

from jaxserve.core.ngram_proposer import propose_ngram
from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import SpecDecodingStats
from jaxserve.speculative_config import SpeculativeConfig

# Steps. Short: on stories260K's retelling workload (first drafts accepted half the time, so
# misses come in runs) a cap of 64 left 24% of steps drafting and 1.41 tokens a step, a cap of
# 4 made it 31% and 1.71 (+15% tokens/s); where drafts never hit, the engine's switch still
# turns drafting off.
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
        return (self.enabled and request.drafts_resume_step <= step
                and not params.needs_host_history
                and request.num_output_tokens >= params.min_tokens
                and not 0 < spec.disable_by_batch_size <= num_running)

    def drafts(self, request: Request, budget: int, num_running: int, step: int) -> list[int]:
        """This step's drafts: none unless `may_draft`, or past max_tokens, max_model_len or
        the budget (tokens in flight counted as if all were accepted); -1 for a draft the step
        proposes on the device (layer skip, draft model)."""
        if not self.may_draft(request, num_running, step):
            return []
        spec = self.spec
        in_flight = request.num_tokens_in_flight
        k = min(spec.num_speculative_tokens, budget,
                request.max_tokens - request.num_output_tokens - in_flight - 1,
                self.max_model_len - request.num_tokens - in_flight)
        if k <= 0:
            return []
        if spec.method == "ngram":
            # At most one step runs ahead: its drafts, then its sample, whose stand-in is the
            # lookup's first proposal.
            guesses = request.num_output_placeholders
            proposal = propose_ngram(request.all_token_ids + request.draft_placeholders,
                                     guesses + k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            return proposal[guesses:]
        return [-1] * k

    def record(self, request: Request, num_drafted: int, num_accepted: int, step: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        request.missed_a_draft = num_accepted < num_drafted
        if num_accepted:
            request.draft_misses = 0
            return
        request.draft_misses += 1
        request.drafts_resume_step = step + min(2 ** request.draft_misses, MAX_BACKOFF)
