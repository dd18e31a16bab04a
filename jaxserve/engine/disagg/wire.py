"""What crosses the loopback socket between the decode process and the prefill process.

Messages are tuples sent with `multiprocessing.connection` (authenticated with a random key),
except KV, which goes as a small header followed by the raw bytes of K and V.

    decode -> prefill: ("init", engine kwargs, heads, max_pending_transfers, kv_transport),
                       ("kv_transport", "jax_transfer" | "bytes"): what the decode side uses,
                       ("add", request fields), ("abort", ids), ("pull", id, first block,
                       number of blocks), ("state",), ("close",)
    prefill -> decode: ("started", info), ("outputs", first tokens, EngineStats),
                       ("stats", EngineStats) after handling messages,
                       ("kv", id, shape, dtype, num_blocks) + 2 byte buffers, or
                       ("kv_offer", id, number, shape, dtype name, num_blocks) to pull from
                       JAX's transfer server, ("state", dict),
                       ("error", traceback text)
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np

AUTHKEY_ENV = "JAXSERVE_DISAGG_AUTHKEY"


def send_kv(conn: Connection, request_id: str, k: np.ndarray, v: np.ndarray) -> None:
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    conn.send(("kv", request_id, k.shape, k.dtype, k.shape[2]))  # the dtype object: bf16 too
    conn.send_bytes(k.reshape(-1).view(np.uint8))
    conn.send_bytes(v.reshape(-1).view(np.uint8))


def recv_kv(conn: Connection, header: tuple) -> tuple[str, np.ndarray, np.ndarray]:
    _, request_id, shape, dtype, _ = header
    k = np.frombuffer(conn.recv_bytes(), dtype).reshape(shape)
    v = np.frombuffer(conn.recv_bytes(), dtype).reshape(shape)
    return request_id, k, v
