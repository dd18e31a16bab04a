"""A GGUF file's metadata and tensor directory, read in one pass over the header.

`gguf.GGUFReader` builds a numpy view per metadata element: on a 49k-token vocabulary with its
merges that takes seconds. Here scalars are unpacked directly, numeric arrays are one
`np.frombuffer` each, and string arrays are sliced from the header bytes; tensors stay views of
a memory map until a loader dequantises them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format (scalars) and numpy dtype (arrays).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dims fastest-first)
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw: float32/float16 elements, or uint8 rows of quantised blocks


class _Header:
    """A cursor over the file's bytes that raises ValueError past the end."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        # One tight loop: a vocabulary and its merges are ~100k strings.
        buf, pos, out, unpack = self.buf, self.pos, [], _U64.unpack_from
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
                pos += 8 + n
        except struct.error:
            pos = len(buf) + 1
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: invalid UTF-8 in a GGUF string at byte {pos}") from e
        if pos > len(buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item == _STRING:
            return self.strings(count)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
        return [self.value(item) for _ in range(count)]  # nested arrays: rare and small


_MISSING = object()


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def field(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value that must be there unless it has a default."""
        value = self.metadata.get(key, default)
        if value is _MISSING:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value

    def int_field(self, key: str, default: Any = _MISSING) -> int:
        value = self.field(key, default)
        if isinstance(value, list):  # per-layer values (llama.cpp allows them for some keys)
            if len(set(value)) != 1:
                raise ValueError(f"{self.path}: GGUF metadata {key!r} differs between layers "
                                 f"({value}); jaxserve needs one value for all layers")
            value = value[0]
        return int(value)

    def token_id(self, key: str) -> int | None:
        """`tokenizer.ggml.{key}` when it names a token of the vocabulary (files write -1 as
        0xFFFFFFFF for "none")."""
        value = self.metadata.get(f"tokenizer.ggml.{key}")
        tokens = self.metadata.get("tokenizer.ggml.tokens") or ()
        return int(value) if value is not None and 0 <= value < len(tokens) else None

    def f32_field(self, key: str, default: float) -> float:
        """The shortest decimal that rounds to the stored float32 (GGUF stores 1e-5 as one)."""
        return float(np.format_float_positional(np.float32(self.field(key, default))))


def read_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    try:
        # A plain ndarray over the map: numpy's memmap subclass costs microseconds per view,
        # and dequantising takes tens of thousands of them.
        mapped = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    except (OSError, ValueError) as e:  # unreadable, or empty (mmap of 0 bytes)
        raise ValueError(f"{path}: cannot read GGUF file: {e}") from e
    h = _Header(memoryview(mapped), path)
    if bytes(h.take(4)) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    version = h.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_kv = h.scalar("<Q"), h.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = h.string()
        metadata[key] = h.value(h.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = h.string()
        dims = [h.scalar("<Q") for _ in range(h.scalar("<I"))]
        kind, offset = h.scalar("<I"), h.scalar("<Q")
        infos.append((name, dims, kind, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-h.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGUF type {kind}") from None
        tensors[name] = _tensor(mapped, path, name, dims, qtype, start + offset)
    return GGUFFile(path, metadata, tensors)


def _tensor(mapped: np.ndarray, path: Path, name: str, dims: list[int],
            qtype: GGMLQuantizationType, begin: int) -> GGUFTensor:
    shape = tuple(reversed(dims))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if not dims or dims[0] % block:
        raise ValueError(f"{path}: tensor {name!r} has a row of {dims[0] if dims else 0} "
                         f"elements, not a multiple of {qtype.name}'s block of {block}")
    row_bytes = dims[0] // block * type_size
    nbytes = row_bytes * int(np.prod(shape[:-1], dtype=np.int64))
    if begin + nbytes > mapped.size:
        raise ValueError(f"{path}: truncated GGUF data: tensor {name!r} ends at byte "
                         f"{begin + nbytes}, the file has {mapped.size}")
    raw = mapped[begin:begin + nbytes]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
        data = data.reshape(shape)
    else:
        data = raw.reshape(*shape[:-1], row_bytes)
    return GGUFTensor(name, shape, qtype, data)
