"""The prefill process of the socket connector: `python -m jaxserve.engine.disagg.
prefill_server HOST:PORT`, started by the decode process, which listens there. The key comes in
the environment (JAXSERVE_DISAGG_AUTHKEY, hex); the engine arguments in the first message.

The loop steps the prefill engine (with async scheduling: launch a step, then apply the one
before), then handles the messages that came meanwhile. Host copies and sends of KV run on a
sender thread, so they overlap the next steps.
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
from jaxserve.engine.disagg import jax_transfer
from jaxserve.engine.disagg.prefill_engine import PrefillEngine
from jaxserve.engine.disagg.wire import AUTHKEY_ENV, send_kv

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
                 max_pending_transfers: int, kv_transport: str):
        self.conn = conn
        self.heads = heads
        config = EngineConfig.from_kwargs(**engine_kwargs)
        self.engine = PrefillEngine(config, None, max_pending_transfers)
        if config.runner.precompile:
            self.engine.warm_up_reads(heads)
        server = None if kv_transport == "bytes" else jax_transfer.start_server(
            self.engine.core.executor.worker.mesh.devices.flat[0])
        if server is None and kv_transport == "jax_transfer":
            raise RuntimeError("disaggregation.kv_transport is 'jax_transfer', but JAX's "
                               "transfer server does not start in the prefill process")
        self.offers = None if server is None else jax_transfer.Offers(server)
        self.sender = _Sender(conn)
        self.sender.put(("started", {"root_hash": self.engine.root_hash,
                                     "transfer_address": server and server.address()}))

    def serve(self) -> None:
        while True:
            outputs = self.engine.step()
            if outputs:
                self.sender.put(("outputs", outputs, self.engine.stats()))
            busy = self.engine.core.has_unfinished_requests()
            if not self._handle_messages(0.0 if busy else _IDLE_POLL_S):
                break
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
                self.engine.add_request(message[1])
            elif kind == "abort":
                self.engine.abort_requests(message[1])
            elif kind == "pull":
                _, req_id, first_block, num_blocks = message
                k, v = self.engine.read_kv(req_id, self.heads, first_block, num_blocks)
                if self.offers is None:
                    self.sender.put(("kv", req_id, k, v, num_blocks))
                else:
                    self.sender.put(("kv_offer", req_id, *self.offers.offer(k, v), num_blocks))
            elif kind == "kv_transport":  # the decode side could not connect: bytes, then
                if message[1] == "bytes":
                    self.offers = None
            elif kind == "state":
                self.sender.put(("state", {"stats": self.engine.stats(),
                                           **self.engine.state()}))
            elif kind == "close":
                return False
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        if changed:
            self.sender.put(("stats", self.engine.stats()))
        return True


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    conn = Client((host, int(port)), authkey=authkey)
    server = None
    try:
        kind, engine_kwargs, heads, max_pending_transfers, kv_transport = conn.recv()
        if kind != "init":
            raise ValueError(f"expected an init message, got {kind!r}")
        server = PrefillServer(conn, engine_kwargs, tuple(heads), max_pending_transfers,
                               kv_transport)
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
