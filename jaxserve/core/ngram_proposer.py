"""N-gram (prompt lookup) drafts: the tokens that followed the last match of the sequence's
own suffix, tried from the longest suffix down (no model, host only, no jax)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int,
                  ) -> list[int]:
    """Up to `num_tokens` drafts: for the longest n in [min_n, max_n] whose last-n tokens
    occurred earlier, the tokens after their most recent earlier occurrence; [] when none."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows start at i <= length - 1 - n: every one has a token after it.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []
