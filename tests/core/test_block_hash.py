import hashlib
import os
import subprocess
import sys

import pytest

from jaxserve.core.block_hash import (
    ExtraKeyKind,
    encode_extra_keys,
    extend_block_hashes,
    hash_block_tokens,
    make_root_hash,
    request_extra_keys,
)

ROOT = make_root_hash(0)


def hashes(tokens: list[int], block_size: int = 4, root: bytes = ROOT,
           **kw: str | None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, root, **kw)
    return out


def test_only_full_blocks_are_hashed() -> None:
    assert len(hashes(list(range(11)))) == 2
    assert len(hashes(list(range(12)))) == 3
    assert hashes(list(range(3))) == []


def test_chain_matches_block_by_block_hashing() -> None:
    tokens = list(range(100, 112))
    first, later = request_extra_keys("salt")
    expected, parent = [], ROOT
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4], first if i == 0 else later)
        expected.append(parent)
    assert hashes(tokens, cache_salt="salt") == expected
    assert all(len(h) == 32 for h in expected)


def test_incremental_extension_equals_one_shot() -> None:
    tokens = list(range(37))
    out: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(out, tokens[:n], 4, ROOT, cache_salt="s")
    assert out == hashes(tokens, cache_salt="s")


def test_a_changed_token_changes_its_block_and_every_later_one_only() -> None:
    base = hashes(list(range(16)))
    tokens = list(range(16))
    tokens[9] = 999
    changed = hashes(tokens)
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(changed[2:], base[2:]))


def test_salt_enters_first_block_keys_only_but_changes_every_hash() -> None:
    tokens = list(range(12))
    salted = hashes(tokens, cache_salt="tenant")
    plain = hashes(tokens)
    assert all(a != b for a, b in zip(salted, plain))
    first, later = request_extra_keys("tenant")
    assert later == b"" and first != b""
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:8])


def test_an_empty_salt_is_not_no_salt() -> None:
    tokens = list(range(8))
    assert hashes(tokens, cache_salt="") != hashes(tokens)


def test_extra_key_encoding_is_canonical_and_unambiguous() -> None:
    other = 2  # a kind to come (an adapter name): the encoding takes any tag byte
    a = [(other, b"l"), (ExtraKeyKind.CACHE_SALT, b"s")]
    assert encode_extra_keys(a) == encode_extra_keys(list(reversed(a)))
    # Length prefixes keep value boundaries: ("ab", "") and ("a", "b") differ.
    assert encode_extra_keys([(ExtraKeyKind.CACHE_SALT, b"ab"), (other, b"")]) != \
        encode_extra_keys([(ExtraKeyKind.CACHE_SALT, b"a"), (other, b"b")])


def test_token_count_and_extra_keys_cannot_be_confused() -> None:
    # A block of tokens [1, 2] with no keys vs a block [1] whose keys happen to encode "2".
    two = int(2).to_bytes(4, "little")
    assert hash_block_tokens(ROOT, [1, 2]) != hash_block_tokens(ROOT, [1], two)


def test_seeded_root_hash_is_reproducible_and_typed() -> None:
    assert make_root_hash(7) == make_root_hash(7)
    assert make_root_hash(7) != make_root_hash(8)
    assert make_root_hash(7) != make_root_hash("7")
    assert make_root_hash(None) != make_root_hash(None)
    assert len(make_root_hash(None)) == 32


def test_seeded_hashes_match_across_processes() -> None:
    code = ("from jaxserve.core.block_hash import extend_block_hashes, make_root_hash\n"
            "out = []\n"
            "extend_block_hashes(out, list(range(40)), 8, make_root_hash('seed'), 'salt')\n"
            "print(b''.join(out).hex())")
    runs = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        runs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    local = b"".join(hashes(list(range(40)), 8, make_root_hash("seed"),
                            cache_salt="salt")).hex()
    assert runs == {local}


def test_root_hash_is_sha256_of_a_tagged_seed() -> None:
    assert make_root_hash("abc") == hashlib.sha256(b"jaxserve-root\0sabc").digest()


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [1.5, 0, 0, 0]])
def test_bad_token_ids_raise_value_error(bad: list) -> None:
    with pytest.raises(ValueError, match="token ids"):
        hashes(bad)


@pytest.mark.parametrize("bad", [1.0, True, [1]])
def test_bad_seed_raises_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="hash_seed"):
        make_root_hash(bad)  # type: ignore[arg-type]


def test_bad_parent_hash_raises_value_error() -> None:
    with pytest.raises(ValueError, match="parent hash"):
        hash_block_tokens(b"short", [1, 2])
