"""Verifying drafts: which of a request's drafts the target model accepts.

Every draft here is a single token proposed deterministically (an n-gram lookup, or a draft
model's argmax), so its proposal distribution q is one-hot. Rejection sampling (Leviathan et
al.) accepts draft x with probability min(1, p(x) / q(x)) = p(x) and, on rejection, samples
from the residual max(p - q, 0), which is p with x removed and renormalised. Sampling y ~ p
at the draft's position and accepting exactly when y == x does both at once: P(accept) = p(x),
and a rejected y is distributed as p given y != x. So the step samples every draft position
with the ordinary sampler (its own seeded key, filters and temperature), and a request's
tokens are its longest run of drafts equal to what was sampled, then the sample after that run:
the target's distribution, token by token, and greedy's argmax exactly.
"""

from __future__ import annotations

import numpy as np


def accepted_tokens(sampled: np.ndarray, sample_starts: np.ndarray,
                    drafts: list[list[int]] | list[np.ndarray]) -> list[list[int]]:
    """sampled i32[S]: the token sampled at every sample row; request i's rows are
    sample_starts[i] .. sample_starts[i + 1] - 1 (one per draft, then its own). Per request:
    the accepted drafts and the token sampled after them."""
    if sample_starts[-1] == len(drafts):  # no drafts: one row a request (the plain step)
        return [[t] for t in sampled[:len(drafts)].tolist()]
    out = []
    for i, d in enumerate(drafts):
        rows = sampled[sample_starts[i]:sample_starts[i + 1]]
        num_drafts = len(d)
        if num_drafts == 0:
            out.append([int(rows[0])])
            continue
        mismatch = np.flatnonzero(rows[:num_drafts] != np.asarray(d))
        accepted = int(mismatch[0]) if mismatch.size else num_drafts
        out.append(rows[:accepted + 1].tolist())
    return out
