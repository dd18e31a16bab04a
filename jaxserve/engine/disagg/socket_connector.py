"""The cross-process connector: the prefill engine runs in a child process on this host and
sends first tokens and KV bytes back over loopback (127.0.0.1, authenticated with a random key).

A background thread receives, so KV bytes land while the decode side computes; the engine
thread only sends (small messages) and drains the inbox once per step.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.disagg.connector import (KVConnector, PrefillEvents, TransferredKV,
                                                   kv_nbytes)
from jaxserve.engine.disagg.wire import AUTHKEY_ENV, recv_kv, request_fields
from jaxserve.engine.core import EngineCore, EngineStats
from jaxserve.executor.kv_blocks import transfer_heads
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.core.request import Request, RequestStatus

_IDLE_WAIT_S = 0.02  # how long an idle decode side waits for the prefill process per step


class PrefillProcessError(RuntimeError):
    pass


class SocketConnector(KVConnector):
    def __init__(self, prefill_config: EngineConfig, settings: dict[str, Any],
                 loaded: LoadedModel, decode: EngineCore):
        self.decode = decode
        self.heads = transfer_heads(loaded.config.num_kv_heads,
                                    prefill_config.parallel.tensor_parallel_size,
                                    decode.config.parallel.tensor_parallel_size)
        timeout = settings["startup_timeout_s"]
        authkey = os.urandom(32)
        self.listener = Listener(("127.0.0.1", settings["port"]), authkey=authkey)
        self.log_path = Path(tempfile.mkstemp(prefix="jaxserve-prefill-", suffix=".log")[1])
        host, port = self.listener.address
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jaxserve.engine.disagg.prefill_server",
                 f"{host}:{port}"], env=_child_env(settings["prefill"], authkey),
                stdout=log, stderr=subprocess.STDOUT)
        self._finalizer = weakref.finalize(self, _shut_down, self.process, self.listener)
        self.conn = self._accept(timeout)
        self.conn.send(("init", prefill_config.to_kwargs(), self.heads,
                        settings["max_pending_transfers"]))
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[tuple] = []  # received while waiting for a state reply
        self._pulled: dict[str, float] = {}
        threading.Thread(target=self._receive, name="disagg-receiver", daemon=True).start()
        started = self._wait_for("started", timeout)
        self.root_hash = started[1]["root_hash"]
        self._stats: EngineStats | None = None

    # ---- start-up and shut-down ----------------------------------------------------------
    def _accept(self, timeout: float) -> Connection:
        accepted: list[Connection] = []
        thread = threading.Thread(target=lambda: accepted.append(self.listener.accept()),
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline and self.process.poll() is None:
            thread.join(0.1)
        if not accepted:
            self.close()
            raise PrefillProcessError(f"the prefill process did not connect within {timeout} s "
                                      f"(exit code {self.process.poll()}):\n{self._log_tail()}")
        return accepted[0]

    def close(self) -> None:
        try:
            if hasattr(self, "conn"):
                self.conn.send(("close",))
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if hasattr(self, "conn"):
            self.conn.close()
        self._finalizer()

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    # ---- receiving -----------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "kv":
                    req_id, k, v = recv_kv(self.conn, message)
                    message = ("kv", req_id, k, v, time.perf_counter())
                self.inbox.put(message)
        except (EOFError, OSError) as e:
            self.inbox.put(("dead", repr(e)))

    def _next(self, timeout: float | None) -> tuple | None:
        try:
            message = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None
        if message[0] in ("error", "dead"):
            raise PrefillProcessError(f"the prefill process failed: {message[1]}\n"
                                      f"{self._log_tail()}")
        return message

    def _wait_for(self, kind: str, timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self._next(0.1)
            if message is None:
                if self.process.poll() is not None:
                    raise PrefillProcessError(f"the prefill process exited "
                                              f"({self.process.returncode}):\n{self._log_tail()}")
            elif message[0] == kind:
                return message
            else:
                self._held.append(message)
        raise PrefillProcessError(f"no {kind!r} from the prefill process in {timeout} s")

    # ---- the connector -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.conn.send(("add", request_fields(request)))

    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for req_id in request_ids:
            self._pulled.pop(req_id, None)
        self.conn.send(("abort", list(request_ids), int(status)))

    def start_step(self) -> None:
        pass  # the prefill process steps on its own

    def finish_step(self, idle: bool) -> PrefillEvents:
        events = PrefillEvents()
        messages, self._held = self._held, []
        first = self._next(_IDLE_WAIT_S if idle and not messages else None)
        while first is not None:
            messages.append(first)
            first = self._next(None)
        for message in messages:
            if message[0] == "outputs":
                events.outputs.extend(message[1])
                self._stats = message[2]
            elif message[0] == "stats":
                self._stats = message[1]
            elif message[0] == "kv":
                _, req_id, k, v, arrived = message
                n = k.shape[2]
                events.arrived.append(TransferredKV(
                    req_id, k, v, n, kv_nbytes(self.decode, self.heads, n),
                    arrived - self._pulled.pop(req_id, arrived)))
        return events

    def pull(self, request_id: str, rank: int) -> None:
        self._pulled[request_id] = time.perf_counter()
        self.conn.send(("pull", request_id))
        return None

    def stats(self) -> EngineStats:
        if self._stats is None:
            self._stats = self.state()["stats"]
        return self._stats

    def state(self) -> dict[str, Any]:
        """The prefill process's state now (after every message sent before): stats, parked
        requests, free blocks per rank. A round trip: for tests and diagnostics."""
        self.conn.send(("state",))
        state = self._wait_for("state", 60.0)[1]
        self._stats = state["stats"]
        return state


def _child_env(prefill: dict[str, Any], authkey: bytes) -> dict[str, str]:
    env = dict(os.environ, **prefill.get("env", {}))
    env[AUTHKEY_ENV] = authkey.hex()
    if jax.default_backend() == "cpu" and "XLA_FLAGS" not in prefill.get("env", {}):
        # CPU devices are virtual: give the child as many as its side uses.
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        count = max(prefill["devices"]) + 1
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _shut_down(process: subprocess.Popen, listener: Listener) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)
    listener.close()
