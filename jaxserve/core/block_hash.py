"""Chained prefix-cache hashes of full KV blocks.

hash(block i) = sha256(parent_hash || u32 token count || token ids as u32 LE || extra keys)

The parent of block 0 is the engine's root hash. Every field has a fixed width or a length
prefix, so the byte string parses one way only: two different (parent, tokens, extra keys)
inputs never encode to the same bytes.

Why sha256 is safe here: a shared hash means a request reads another prompt's KV, so a collision
would silently corrupt output (and, across `cache_salt` tenants, leak data). With 256-bit digests
the chance that any two of 2**40 cached blocks ever collide is about 2**80 / 2**257 = 2**-177,
and no way to construct a sha256 collision on purpose is known, so a tenant cannot craft one
either. Python's `hash` (64 bits, salted per process) and pickle (not a canonical encoding) would
give neither guarantee nor reproducibility across processes.
"""

from __future__ import annotations

import array
import enum
import hashlib
import os
import sys
from collections.abc import Iterable, Sequence

BlockHash = bytes

HASH_NBYTES = 32

_U32 = next(code for code in ("I", "L") if array.array(code).itemsize == 4)


class ExtraKeyKind(enum.IntEnum):
    """Tag byte of an extra key; each kind has its own tag so kinds can never collide."""

    CACHE_SALT = 1  # only on the first block; the chain carries it to the rest
    # Room for more (an adapter name on every block, multimodal features), e.g. LORA_NAME = 2.


def make_root_hash(seed: int | str | bytes | None) -> BlockHash:
    """Chain seed: sha256 of the seed when given (same in every process), else random."""
    if seed is None:
        return os.urandom(HASH_NBYTES)
    if isinstance(seed, bool) or not isinstance(seed, (int, str, bytes)):
        raise ValueError(f"hash_seed must be an int, str, bytes or None, got {seed!r}")
    if isinstance(seed, int):
        kind, raw = b"i", str(seed).encode()
    elif isinstance(seed, str):
        kind, raw = b"s", seed.encode()
    else:
        kind, raw = b"b", seed
    return hashlib.sha256(b"jaxserve-root\0" + kind + raw).digest()


def encode_extra_keys(keys: Iterable[tuple[ExtraKeyKind, bytes]]) -> bytes:
    """Canonical bytes of (kind, value) pairs: tag byte + u32 length + value, sorted by kind."""
    out = bytearray()
    for kind, value in sorted(keys, key=lambda kv: int(kv[0])):
        out += int(kind).to_bytes(1, "little") + len(value).to_bytes(4, "little") + value
    return bytes(out)


def request_extra_keys(cache_salt: str | None) -> tuple[bytes, bytes]:
    """Encoded extra keys for (the first block, every later block) of one request."""
    first = [] if cache_salt is None else [(ExtraKeyKind.CACHE_SALT, cache_salt.encode())]
    return encode_extra_keys(first), b""


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32; ValueError for ids outside [0, 2**32)."""
    try:
        packed = array.array(_U32, token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32), got {e}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int],
                      extra_keys: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash and already-encoded extra keys."""
    if len(parent) != HASH_NBYTES:
        raise ValueError(f"parent hash must be {HASH_NBYTES} bytes, got {len(parent)}")
    return hashlib.sha256(
        parent + len(token_ids).to_bytes(4, "little") + token_bytes(token_ids) + extra_keys
    ).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root_hash: BlockHash,
    cache_salt: str | None = None,
) -> None:
    """Append to `block_hashes` the hashes of the full blocks of `token_ids` it lacks."""
    start = len(block_hashes)
    end = len(token_ids) // block_size
    if end <= start:
        return
    if len(root_hash) != HASH_NBYTES:
        raise ValueError(f"root hash must be {HASH_NBYTES} bytes, got {len(root_hash)}")
    first_keys, later_keys = request_extra_keys(cache_salt)
    raw = token_bytes(token_ids[start * block_size : end * block_size])
    count = block_size.to_bytes(4, "little")
    nbytes = 4 * block_size
    parent = block_hashes[-1] if start else root_hash
    sha256 = hashlib.sha256
    for i in range(start, end):
        off = (i - start) * nbytes
        keys = first_keys if i == 0 else later_keys
        parent = sha256(parent + count + raw[off : off + nbytes] + keys).digest()
        block_hashes.append(parent)
