"""What crosses the loopback socket between the decode process and the prefill process.

Messages are tuples sent with `multiprocessing.connection` (authenticated with a random key),
except KV, which goes as a small header followed by the raw bytes of K and V.

    decode -> prefill: ("init", engine kwargs, heads, max_parked), ("add", request fields),
                       ("abort", ids, status), ("pull", id), ("state",), ("close",)
    prefill -> decode: ("started", info), ("outputs", [EngineCoreOutput], EngineStats),
                       ("stats", EngineStats) after handling messages,
                       ("kv", id, shape, dtype, num_blocks) + 2 byte buffers, ("state", dict),
                       ("error", traceback text)
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from jaxserve.core.request import Request

AUTHKEY_ENV = "JAXSERVE_DISAGG_AUTHKEY"


def request_fields(request: Request) -> dict[str, Any]:
    return dict(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params, arrival_time=request.arrival_time,
                priority=request.priority, cache_salt=request.cache_salt,
                lora_name=request.lora_name, max_tokens=request.max_tokens, seed=request.seed,
                group_id=request.group_id)


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
