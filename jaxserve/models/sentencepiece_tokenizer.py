"""SentencePiece-style BPE of llama2.c (`tok512.bin`) and GGUF (`tokenizer.ggml.*`) vocabularies.

Encoding follows llama2.c: BOS, a leading space for non-empty text, every UTF-8 character looked
up as a piece (or its bytes as `<0xHH>` byte tokens), then repeatedly merge the adjacent pair
whose concatenation is a piece of the highest score (leftmost on ties). Decoding drops the
leading space of the piece right after BOS and maps byte tokens to raw bytes.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxserve.models.tokenizer import Tokenizer

# SentencePiece / GGUF token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, pieces: Sequence[str], scores: Sequence[float],
                 token_types: Sequence[int] | None = None, *, bos_token_id: int | None = 1,
                 eos_token_id: int | None = 2, unk_token_id: int | None = 0) -> None:
        if len(pieces) != len(scores):
            raise ValueError(f"sentencepiece vocab: {len(pieces)} pieces but {len(scores)} scores")
        if token_types is not None and len(token_types) != len(pieces):
            raise ValueError(f"sentencepiece vocab: {len(pieces)} pieces but {len(token_types)} "
                             "token types")
        self.pieces = list(pieces)
        self.scores = [float(s) for s in scores]
        self.vocab_size = len(self.pieces)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.bos_token, self.eos_token = (
            self.pieces[i] if i is not None and 0 <= i < len(self.pieces) else None
            for i in (bos_token_id, eos_token_id))
        self.token_types = (list(token_types) if token_types is not None
                            else self._infer_types())
        self._byte_value: dict[int, int] = {}  # byte-token id -> byte
        self._byte_token = [unk_token_id] * 256  # byte -> byte-token id
        self._piece_id: dict[str, int] = {}  # mergeable pieces only
        for i, (piece, kind) in enumerate(zip(self.pieces, self.token_types)):
            if kind == BYTE:
                match = _BYTE_PIECE.fullmatch(piece)
                if match is None:
                    raise ValueError(f"sentencepiece vocab: byte token {i} is {piece!r}, "
                                     "expected <0xHH>")
                value = int(match.group(1), 16)
                self._byte_value[i] = value
                self._byte_token[value] = i
            elif kind in (NORMAL, USER_DEFINED):
                self._piece_id.setdefault(piece, i)
        self._special = {i for i, kind in enumerate(self.token_types)
                         if kind in (CONTROL, UNKNOWN, UNUSED)}

    def _infer_types(self) -> list[int]:
        types = []
        for i, piece in enumerate(self.pieces):
            if i == self.unk_token_id:
                types.append(UNKNOWN)
            elif i in (self.bos_token_id, self.eos_token_id):
                types.append(CONTROL)
            elif _BYTE_PIECE.fullmatch(piece):
                types.append(BYTE)
            else:
                types.append(NORMAL)
        return types

    @classmethod
    def from_llama2c(cls, path: str | Path, vocab_size: int) -> "SentencePieceTokenizer":
        """Read a llama2.c tokenizer export: int32 max_token_length, then per token a float32
        score, an int32 byte length and the raw bytes. The file does not store the count."""
        data = Path(path).read_bytes()
        pieces: list[str] = []
        scores: list[float] = []
        offset = 4
        try:
            for _ in range(vocab_size):
                score, length = struct.unpack_from("<fi", data, offset)
                offset += 8
                if length < 0 or offset + length > len(data):
                    raise struct.error(f"piece length {length}")
                pieces.append(data[offset:offset + length].decode("utf-8", "surrogateescape"))
                scores.append(score)
                offset += length
        except struct.error as e:
            raise ValueError(f"{path}: truncated or corrupt tokenizer file after {len(pieces)} of "
                             f"{vocab_size} pieces ({e})") from e
        if offset != len(data):
            raise ValueError(f"{path}: {len(data) - offset} bytes left after {vocab_size} pieces; "
                             "does the vocab size match the model?")
        return cls(pieces, scores)

    @classmethod
    def from_gguf_fields(cls, tokens: Sequence[str], scores: Sequence[float] | None,
                         token_types: Sequence[int] | None, *, bos_token_id: int | None,
                         eos_token_id: int | None, unk_token_id: int | None
                         ) -> "SentencePieceTokenizer":
        pieces = [t.replace("\u2581", " ") for t in tokens]
        return cls(pieces, scores if scores is not None else [0.0] * len(pieces), token_types,
                   bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   unk_token_id=unk_token_id)

    def to_dict(self) -> dict[str, Any]:
        return {"pieces": self.pieces, "scores": self.scores, "token_types": self.token_types,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "unk_token_id": self.unk_token_id}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SentencePieceTokenizer":
        return cls(d["pieces"], d["scores"], d["token_types"], bos_token_id=d["bos_token_id"],
                   eos_token_id=d["eos_token_id"], unk_token_id=d["unk_token_id"])

    def _initial_ids(self, text: str) -> list[int]:
        ids: list[int] = []
        for char in text:
            piece_id = self._piece_id.get(char)
            if piece_id is not None:
                ids.append(piece_id)
                continue
            for byte in char.encode("utf-8", "surrogateescape"):
                token = self._byte_token[byte]
                if token is None:
                    raise ValueError(f"sentencepiece vocab has no byte token for 0x{byte:02X} "
                                     f"(character {char!r}) and no unk token")
                ids.append(token)
        return ids

    def _merge(self, ids: list[int]) -> list[int]:
        # Doubly linked list over the initial tokens plus a heap of candidate merges; a heap
        # entry is stale when either side has changed since it was pushed. Ordering by
        # (-score, left position) reproduces "best score, leftmost first".
        n = len(ids)
        pieces = [self.pieces[i] for i in ids]
        token = list(ids)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, str, str]] = []

        def push(left: int) -> None:
            right = nxt[left]
            if right >= n:
                return
            merged_id = self._piece_id.get(pieces[left] + pieces[right])
            if merged_id is not None:
                heapq.heappush(heap, (-self.scores[merged_id], left, right, pieces[left],
                                      pieces[right]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, right, left_piece, right_piece = heapq.heappop(heap)
            if (not alive[left] or not alive[right] or nxt[left] != right
                    or pieces[left] != left_piece or pieces[right] != right_piece):
                continue
            pieces[left] = left_piece + right_piece
            token[left] = self._piece_id[pieces[left]]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prev[nxt[right]] = left
            if prev[left] >= 0:
                push(prev[left])
            push(left)
        return [token[i] for i in range(n) if alive[i]]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._merge(self._initial_ids(" " + text)) if text else []
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def get_vocab(self) -> dict[str, int]:
        return {piece: i for i, piece in reversed(list(enumerate(self.pieces)))}  # first id

    def max_token_chars(self) -> int | None:
        return max(map(len, self.pieces), default=1)  # byte pieces "<0x41>" only overcount

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        prev: int | None = None
        for token_id in token_ids:
            token_id = int(token_id)
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary "
                                 f"(size {self.vocab_size})")
            if token_id in self._byte_value:
                out.append(self._byte_value[token_id])
            elif not (skip_special_tokens and token_id in self._special):
                piece = self.pieces[token_id]
                if prev == self.bos_token_id and piece.startswith(" "):
                    piece = piece[1:]
                out += piece.encode("utf-8", "surrogateescape")
            prev = token_id
        return out.decode("utf-8", "replace")
