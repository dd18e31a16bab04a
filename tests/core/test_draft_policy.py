"""Who drafts (core/draft_policy.py): a request backs off after verifications that accepted
nothing while it shares the step, never while it runs alone."""

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.block_hash import HASH_NBYTES
from jaxserve.core.draft_policy import MAX_BACKOFF, DraftPolicy
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

SPEC = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)


def request() -> Request:
    return Request(request_id="r", prompt_token_ids=[1, 2, 3], arrival_time=0.0,
                   sampling_params=SamplingParams(max_tokens=100), block_size=16,
                   hash_seed=bytes(HASH_NBYTES), max_tokens=100)


def drafting_steps(num_running: int, misses_at: set[int], steps: int = 12) -> list[int]:
    """The steps at which the request gets drafts when every verification at `misses_at`
    accepts nothing (and every other one accepts a draft)."""
    policy, req, out = DraftPolicy(SPEC, max_model_len=1000), request(), []
    for step in range(steps):
        drafts = policy.drafts(req, budget=100, num_running=num_running, step=step)
        if drafts:
            assert drafts == [-1, -1, -1]  # slots: the step proposes the drafts
            out.append(step)
            policy.record(req, len(drafts), 0 if step in misses_at else 1, step)
    return out


def test_misses_back_off_longer_each_time_up_to_the_cap_while_sharing_the_step():
    assert MAX_BACKOFF == 4
    # misses at 0 (resume at 2), 2 (resume at 6), 6 (resume at 10)
    assert drafting_steps(3, misses_at={0, 2, 6}) == [0, 2, 6, 10, 11]
    # a hit resets the count: the miss after it backs off 2 steps again
    assert drafting_steps(3, misses_at={0, 4}) == [0, 2, 3, 4, 6, 7, 8, 9, 10, 11]


def test_a_request_running_alone_drafts_every_step_whatever_it_missed():
    assert drafting_steps(1, misses_at=set(range(12))) == list(range(12))
