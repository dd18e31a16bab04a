"""llama2.c "version 0" checkpoints (`model.bin`) and their `tok*.bin` tokenizer."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.registry import check_params
from jaxserve.models.tokenizer import HFTokenizer
from jaxserve.models.tokenizer_builders import SPACE, infer_token_types, sentencepiece_bpe

_HEADER = struct.Struct("<7i")
_VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's later export versions, not handled here
_UNK, _BOS, _EOS = 0, 1, 2  # llama2.c's SentencePiece ids


def interleaved_to_half_split(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the output rows of a q/k projection `[..., out, in]` (or of a bias `[out]`) from
    interleaved RoPE pairs (2i, 2i+1) to HF's half-split order (i, i + head_dim/2)."""
    if w.ndim == 1:
        rows = w.shape[0]
        return w.reshape(n_heads, rows // n_heads // 2, 2).transpose(0, 2, 1).reshape(rows)
    rows, cols = w.shape[-2:]
    lead = w.shape[:-2]
    out = w.reshape(*lead, n_heads, rows // n_heads // 2, 2, cols)
    out = np.swapaxes(out, -3, -2)
    return out.reshape(*lead, rows, cols)


def _find_tokenizer(model_path: Path, vocab_size: int) -> Path | None:
    folder = model_path.parent
    for name in (f"tok{vocab_size}.bin", "tokenizer.bin"):
        if (folder / name).is_file():
            return folder / name
    candidates = sorted(p for p in folder.glob("tok*.bin") if p != model_path)
    return candidates[0] if len(candidates) == 1 else None


def read_llama2c_vocab(path: str | Path, vocab_size: int) -> tuple[list[str], list[float]]:
    """A llama2.c tokenizer export: int32 max_token_length, then per token a float32 score, an
    int32 byte length and the raw bytes (spaces as spaces). The file does not store the count."""
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
            pieces.append(data[offset:offset + length].decode("utf-8"))
            scores.append(score)
            offset += length
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: truncated or corrupt tokenizer file after {len(pieces)} of "
                         f"{vocab_size} pieces ({e})") from e
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes left after {vocab_size} pieces; "
                         "does the vocab size match the model?")
    return pieces, scores


def llama2c_tokenizer(path: str | Path, vocab_size: int) -> HFTokenizer:
    """llama2.c's encode (a leading space, then best-score merges, byte fallback) and BOS."""
    pieces, scores = read_llama2c_vocab(path, vocab_size)
    types = infer_token_types(pieces, _UNK, (_BOS, _EOS))
    tok = sentencepiece_bpe([p.replace(" ", SPACE) for p in pieces], scores, types,
                            unk_id=_UNK)
    return HFTokenizer(tok, {"add_bos_token": True}, bos_token_id=_BOS, eos_token_id=_EOS)


def load_llama2c(path: str | Path) -> LoadedModel:
    path = Path(path)
    size = path.stat().st_size
    if size < _HEADER.size:
        raise ValueError(f"{path}: truncated llama2.c checkpoint ({size} bytes, no header)")
    with open(path, "rb") as f:
        header = _HEADER.unpack(f.read(_HEADER.size))
    if header[0] == _VERSIONED_MAGIC:
        raise ValueError(f"{path}: llama2.c export version 1/2 ('ak42' magic) is not supported; "
                         "export with version 0 (legacy)")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = header
    tied = vocab > 0
    vocab = abs(vocab)
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    for name, value in zip(names, (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)):
        if value <= 0:
            raise ValueError(f"{path}: llama2.c header field {name} must be positive, got {value}")
    if dim % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"{path}: llama2.c header: dim {dim}, n_heads {n_heads}, n_kv_heads "
                         f"{n_kv_heads} do not divide evenly")
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    L = n_layers
    layout: list[tuple[str, tuple[int, ...]]] = [
        ("embed", (vocab, dim)), ("attn_norm", (L, dim)), ("wq", (L, dim, dim)),
        ("wk", (L, kv_dim, dim)), ("wv", (L, kv_dim, dim)), ("wo", (L, dim, dim)),
        ("mlp_norm", (L, dim)), ("w_gate", (L, hidden, dim)), ("w_down", (L, dim, hidden)),
        ("w_up", (L, hidden, dim)), ("final_norm", (dim,)),
        ("rope_real", (seq_len * head_dim // 2,)), ("rope_imag", (seq_len * head_dim // 2,)),
    ]
    if not tied:
        layout.append(("lm_head", (vocab, dim)))
    expected = _HEADER.size + 4 * sum(int(np.prod(shape)) for _, shape in layout)
    if size < expected:
        raise ValueError(f"{path}: truncated llama2.c checkpoint: {size} bytes, the header "
                         f"implies {expected}")
    if size > expected:
        raise ValueError(f"{path}: {size - expected} unexpected trailing bytes after the weights "
                         f"the header implies ({expected} bytes)")
    flat = np.memmap(path, dtype="<f4", mode="r", offset=_HEADER.size)
    raw: dict[str, np.ndarray] = {}
    offset = 0
    for name, shape in layout:
        count = int(np.prod(shape))
        raw[name] = flat[offset:offset + count].reshape(shape)
        offset += count

    params = {
        "embed": np.array(raw["embed"], dtype=np.float32),
        "attn_norm": np.array(raw["attn_norm"], dtype=np.float32),
        "mlp_norm": np.array(raw["mlp_norm"], dtype=np.float32),
        "final_norm": np.array(raw["final_norm"], dtype=np.float32),
        "wq": np.ascontiguousarray(
            np.swapaxes(interleaved_to_half_split(raw["wq"], n_heads), 1, 2), dtype=np.float32),
        "wk": np.ascontiguousarray(
            np.swapaxes(interleaved_to_half_split(raw["wk"], n_kv_heads), 1, 2), dtype=np.float32),
    }
    for name in ("wv", "wo", "w_gate", "w_up", "w_down"):
        params[name] = np.ascontiguousarray(np.swapaxes(raw[name], 1, 2), dtype=np.float32)
    if not tied:
        params["lm_head"] = np.array(raw["lm_head"], dtype=np.float32)
    del flat, raw

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_layers=n_layers,
        num_heads=n_heads, num_kv_heads=n_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=seq_len, tie_word_embeddings=tied,
        bos_token_id=_BOS, eos_token_ids=(_EOS,))
    check_params(config, params, str(path))
    tok_path = _find_tokenizer(path, vocab)
    tokenizer = llama2c_tokenizer(tok_path, vocab) if tok_path else None
    return LoadedModel(config=config, params=params, tokenizer=tokenizer)
