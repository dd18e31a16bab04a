"""N-gram (prompt lookup) drafts on the host, one sequence at a time: the reference the engine's
device proposer (programs/device_drafts.py) is tested against. The tokens that followed the
first match of the sequence's own suffix, tried from the longest suffix down (vLLM's proposer
picks the longest suffix and, among its matches, the first).

The drafts continue the sequence as it went on after the match. When the match ends fewer
than `num_tokens` before the end, that continuation runs into the drafts themselves: the span
since the match repeats (a copy overlapping its own output, as in LZ77), so a sequence caught
in a loop shorter than `num_tokens` still gets every draft it may have."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int,
                  ) -> list[int]:
    """`num_tokens` drafts: for the longest n in [min_n, max_n] whose last-n tokens occurred
    earlier, the tokens after their earliest occurrence, repeating the span from
    there to the end as often as it takes; [] when none."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows start at i <= length - 1 - n: every one has a token after it.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start + np.arange(num_tokens) % (length - start)].tolist()
    return []
