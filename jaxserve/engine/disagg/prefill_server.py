"""The prefill process of the socket connector: `python -m jaxserve.engine.disagg.
prefill_server HOST:PORT`, started by the decode process, which listens there. The key comes in
the environment (JAXSERVE_DISAGG_AUTHKEY, hex); the engine arguments in the first message.

The loop launches a prefill step, handles messages while the devices compute, then collects the
step. Host copies and sends of KV run on a sender thread, so they overlap the next steps.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.disagg.prefill import PrefillSide
from jaxserve.engine.disagg.wire import AUTHKEY_ENV, send_kv
from jaxserve.engine.core import EngineCore
from jaxserve.core.request import Request, RequestStatus

_IDLE_POLL_S = 0.05


class _Sender:
    """The one thread that writes to the connection: messages in order, KV copied to the host
    here (waiting for the device) rather than on the stepping thread."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="prefill-sender", daemon=True)
        self.thread.start()

    def put(self, message: tuple) -> None:
        self.queue.put(message)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if item[0] == "kv":
                    _, req_id, k, v, n = item
                    send_kv(self.conn, req_id, np.asarray(k)[:, :, :n], np.asarray(v)[:, :, :n])
                else:
                    self.conn.send(item)
        except (OSError, EOFError):
            pass  # the decode process went away; the main loop sees it too


class PrefillServer:
    def __init__(self, conn: Connection, engine_kwargs: dict[str, Any], heads: tuple[int, ...],
                 max_parked: int):
        self.conn = conn
        self.heads = heads
        config = EngineConfig.from_kwargs(**engine_kwargs)
        self.side = PrefillSide(EngineCore(config), max_parked)
        if config.runner.precompile:
            self.side.warm_up_reads(heads)
        self.sender = _Sender(conn)
        self.sender.put(("started", {"root_hash": self.side.core.root_hash}))

    def serve(self) -> None:
        while True:
            pending = self.side.dispatch()
            if not self._handle_messages(0.0 if pending is not None else _IDLE_POLL_S):
                break
            if pending is not None:
                outputs = self.side.collect(pending)
                if outputs:
                    self.sender.put(("outputs", outputs, self.side.stats()))
        self.sender.close()

    def _handle_messages(self, timeout: float) -> bool:
        """Handle what has arrived (waiting up to `timeout` for the first); False: stop."""
        changed = False
        while self.conn.poll(timeout):
            timeout = 0.0
            changed = True
            message = self.conn.recv()
            kind = message[0]
            if kind == "add":
                self.side.add_request(Request(**message[1],
                                              block_size=self.side.block_size,
                                              hash_seed=self.side.core.root_hash))
            elif kind == "abort":
                self.side.abort_requests(message[1], RequestStatus(message[2]))
            elif kind == "pull":
                k, v, n = self.side.read_kv(message[1], self.heads)
                self.sender.put(("kv", message[1], k, v, n))
            elif kind == "state":
                self.sender.put(("state", self._state()))
            elif kind == "close":
                return False
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        if changed:
            self.sender.put(("stats", self.side.stats()))
        return True

    def _state(self) -> dict[str, Any]:
        schedulers = self.side.core.schedulers
        return {"stats": self.side.stats(), "num_parked": len(self.side.parked),
                "num_free_blocks": self.side.num_free_blocks(),
                "num_blocks": [s.kv.num_blocks for s in schedulers],
                "num_requests": sum(len(s.requests) for s in schedulers),
                "num_block_owners": sum(len(s.kv.req_to_blocks) for s in schedulers)}


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    conn = Client((host, int(port)), authkey=authkey)
    server = None
    try:
        kind, engine_kwargs, heads, max_parked = conn.recv()
        if kind != "init":
            raise ValueError(f"expected an init message, got {kind!r}")
        server = PrefillServer(conn, engine_kwargs, tuple(heads), max_parked)
        server.serve()
    except (EOFError, ConnectionResetError):
        pass  # the decode process closed the connection: nothing left to serve
    except BaseException:
        error = ("error", traceback.format_exc())
        try:
            if server is None:
                conn.send(error)
            else:  # the sender thread owns the connection
                server.sender.put(error)
                server.sender.close()
        except OSError:
            pass
        raise
    finally:
        conn.close()


if __name__ == "__main__":
    main()
