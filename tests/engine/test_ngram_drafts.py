"""N-gram drafts proposed on the device (programs/device_drafts.py), read from the token cache
through each request's block table: the host reference's drafts (tests/ngram_reference.py)
for every request of a batch, and the last token repeated where the reference finds no
match."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.programs.device_drafts import propose_ngram_drafts, write_tokens
from tests.ngram_reference import propose_ngram

BLOCK_SIZE = 4
PAGES = 8  # up to 32 tokens a sequence


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _propose(min_n: int, max_n: int, k: int, token_cache: jax.Array, input_ids: jax.Array,
             md: AttentionMetadata, draft_starts: jax.Array, num_drafts: jax.Array,
             ) -> tuple[jax.Array, jax.Array]:
    # As the step does: its inputs (each sequence's last token) written first.
    return propose_ngram_drafts(write_tokens(token_cache, input_ids, md), min_n, max_n, k,
                                input_ids, md, draft_starts, num_drafts)


def device_drafts(sequences: list[list[int]], k: int, min_n: int, max_n: int,
                  num_drafts: list[int] | None = None, seed: int = 0,
                  ) -> tuple[list[list[int]], np.ndarray]:
    """Each sequence as a decoding request of one step: its history in the token cache on
    scattered blocks (stale tokens elsewhere), its last token an input and `k` draft slots
    after it. Returns (each request's drafts, the step's input ids)."""
    rng = np.random.default_rng(seed)
    R = len(sequences)
    num_drafts = num_drafts or [k] * R
    blocks = rng.permutation(np.arange(1, R * PAGES + 1)).reshape(R, PAGES).astype(np.int32)
    cache = rng.integers(0, 50, (R * PAGES + 1, BLOCK_SIZE)).astype(np.int32)  # stale
    T = R * (1 + k)
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)
    starts = np.arange(R, dtype=np.int32) * (1 + k)
    for r, seq in enumerate(sequences):
        for pos, tok in enumerate(seq[:-1]):
            cache[blocks[r, pos // BLOCK_SIZE], pos % BLOCK_SIZE] = tok
        for j in range(1 + k):
            pos = len(seq) - 1 + j
            positions[starts[r] + j] = pos
            slots[starts[r] + j] = blocks[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        input_ids[starts[r]] = seq[-1]
    md = AttentionMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots),
                           query_start_loc=jnp.asarray(np.append(starts, T)),
                           seq_lens=jnp.asarray(positions[starts + k] + 1),
                           block_tables=jnp.asarray(blocks))
    ids, drafts = _propose(min_n, max_n, k, jnp.asarray(cache), jnp.asarray(input_ids), md,
                           jnp.asarray(starts), jnp.asarray(num_drafts, jnp.int32))
    return np.asarray(drafts).tolist(), np.asarray(ids)


def expected(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return propose_ngram(seq, k, min_n, max_n) or [seq[-1]] * k


def test_the_tokens_after_the_earliest_match_of_the_longest_suffix():
    # row 0: suffix [7, 8] occurred at 0 (then 1) and at 4 (then 9); [6, 7, 8] only at 3
    # (then 9). Row 1: [7, 8] at 0 (then 1) and at 4 (then 3); [4, 7, 8] never before.
    seqs = [[7, 8, 1, 6, 7, 8, 9, 5, 5, 6, 7, 8], [7, 8, 1, 2, 7, 8, 3, 4, 7, 8]]
    assert device_drafts(seqs, 2, 1, 3)[0] == [[9, 5], [1, 2]]
    assert device_drafts(seqs, 3, 1, 2)[0] == [[1, 6, 7], [1, 2, 7]]


def test_a_match_near_the_end_repeats_the_span_since_it():
    # a loop of period 2: the last match of [1, 2] leaves one token before the end
    assert device_drafts([[5, 1, 2, 1, 2]], 5, 2, 2)[0] == [[1, 2, 1, 2, 1]]
    assert device_drafts([[3, 3], [4, 9, 1, 2, 3, 9]], 4, 1, 1)[0] == [[3, 3, 3, 3],
                                                                       [1, 2, 3, 9]]


def test_no_match_or_too_short_drafts_the_last_token_again():
    assert device_drafts([[1, 2, 3, 4], [1, 2, 3, 1, 2], [5]], 3, 3, 4)[0] == [
        [4, 4, 4], [2, 2, 2], [5, 5, 5]]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_random_batches_match_the_host_reference(min_n: int, max_n: int):
    rng = np.random.default_rng([min_n, max_n])
    for trial in range(5):
        # small vocabularies: many matches, loops and ties
        seqs = [rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, PAGES * BLOCK_SIZE
                                                                           - 4))).tolist()
                for _ in range(6)]
        got, _ = device_drafts(seqs, 4, min_n, max_n, seed=trial)
        assert got == [expected(s, 4, min_n, max_n) for s in seqs]


def test_only_a_requests_own_draft_slots_take_its_drafts():
    seqs = [[1, 2, 3, 1, 2], [4, 5, 4, 5]]
    drafts, ids = device_drafts(seqs, 3, 1, 2, num_drafts=[3, 1])
    assert drafts == [[3, 1, 2], [4, 5, 4]]
    # row 0: its last token, 3 drafts; row 1: its last token, 1 draft, 2 slots left as they were
    assert ids.tolist() == [2, 3, 1, 2, 5, 4, 0, 0]
