"""N-gram drafts (core/ngram_proposer.py): the longest suffix that occurred before, its most
recent occurrence, and the span since then repeated when it is shorter than the drafts."""

from jaxserve.core.ngram_proposer import propose_ngram


def test_the_tokens_after_the_most_recent_match_of_the_longest_suffix():
    # suffix [7, 8] occurred at 0 (then 1) and at 3 (then 2); [6, 7, 8] only at 2 (then 9)
    tokens = [7, 8, 1, 6, 7, 8, 9, 5, 5, 6, 7, 8]
    assert propose_ngram(tokens, 2, min_n=1, max_n=3) == [9, 5]
    assert propose_ngram(tokens, 2, min_n=1, max_n=2) == [9, 5]  # the most recent [7, 8]
    assert propose_ngram([7, 8, 1, 2, 7, 8, 3, 4, 7, 8], 3, 1, 2) == [3, 4, 7]


def test_a_match_near_the_end_repeats_the_span_since_it():
    # a loop of period 2: the last match of [1, 2] leaves one token before the end
    assert propose_ngram([5, 1, 2, 1, 2], 5, min_n=2, max_n=2) == [1, 2, 1, 2, 1]
    assert propose_ngram([3, 3], 4, min_n=1, max_n=1) == [3, 3, 3, 3]
    assert propose_ngram([4, 9, 1, 2, 3, 9], 4, min_n=1, max_n=1) == [1, 2, 3, 9]


def test_no_match_or_too_short_gives_no_drafts():
    assert propose_ngram([1, 2, 3, 4], 3, min_n=1, max_n=2) == []
    assert propose_ngram([1, 2, 3, 1, 2], 3, min_n=3, max_n=4) == []
    assert propose_ngram([5], 3, min_n=1, max_n=1) == []
