"""The cross-process connector: the prefill engine runs in a child process on this host and
sends first tokens back over loopback (127.0.0.1, authenticated with a random key), and KV
through JAX's transfer server where it runs (`jax_transfer`), else as raw bytes on the same
socket (`bytes`).

A background thread receives (and pulls offered KV), so KV lands while the decode side
computes; the engine thread only sends (small messages) and drains the inbox once per step.
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
from jaxserve.config.disaggregation import DisaggregationConfig, DisaggregationSide
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.disagg import jax_transfer
from jaxserve.engine.disagg.wire import AUTHKEY_ENV, recv_kv
from jaxserve.engine.kv_connector import KVConnector, TransferredKV
from jaxserve.engine.stats import EngineStats

_IDLE_WAIT_S = 0.02  # how long an idle decode side waits for the prefill process per step


class PrefillProcessError(RuntimeError):
    pass


class SocketConnector(KVConnector):
    def __init__(self, prefill_config: EngineConfig, settings: DisaggregationConfig,
                 heads: tuple[int, ...]):
        super().__init__(heads)
        timeout = settings.startup_timeout_s
        authkey = os.urandom(32)
        self.listener = Listener(("127.0.0.1", settings.port), authkey=authkey)
        self.log_path = Path(tempfile.mkstemp(prefix="jaxserve-prefill-", suffix=".log")[1])
        host, port = self.listener.address
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jaxserve.engine.disagg.prefill_server",
                 f"{host}:{port}"], env=_child_env(settings.prefill, authkey),
                stdout=log, stderr=subprocess.STDOUT)
        self._finalizer = weakref.finalize(self, _shut_down, self.process, self.listener)
        self.conn = self._accept(timeout)
        self.conn.send(("init", prefill_config.to_kwargs(), self.heads,
                        settings.max_pending_transfers, settings.kv_transport))
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[tuple] = []  # received while waiting for a state reply
        self._pulled: dict[str, float] = {}
        self._pull_ranks: dict[str, int] = {}  # read by the receiver thread
        self._transfer_connection: Any = None
        threading.Thread(target=self._receive_loop, name="disagg-receiver", daemon=True).start()
        started = self._wait_for("started", timeout)[1]
        self._root_hash = started["root_hash"]
        self._stats: EngineStats | None = None
        self.kv_transport = "bytes"
        if started["transfer_address"] is not None:
            self._transfer_server = jax_transfer.start_server(jax.devices()[0])
            if self._transfer_server is not None:
                self._transfer_connection = self._transfer_server.connect(
                    started["transfer_address"])
                self.kv_transport = "jax_transfer"
        if settings.kv_transport == "jax_transfer" != self.kv_transport:
            self.close()
            raise PrefillProcessError("disaggregation.kv_transport is 'jax_transfer', but JAX's "
                                      "transfer server does not start in this process")
        self.conn.send(("kv_transport", self.kv_transport))

    @property
    def root_hash(self) -> bytes:
        return self._root_hash

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
    def _receive_loop(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "kv":
                    req_id, k, v = recv_kv(self.conn, message)
                    message = ("kv", req_id, k, v, k.shape[2], time.perf_counter())
                elif message[0] == "kv_offer":
                    message = self._pull_offer(*message[1:])
                self.inbox.put(message)
        except (EOFError, OSError) as e:
            self.inbox.put(("dead", repr(e)))

    def _pull_offer(self, req_id: str, number: int, shape: tuple[int, ...], dtype: str,
                    num_blocks: int) -> tuple:
        """Fetch offered KV onto the rank's first device, then onto the rank's sharding (a pull
        for an aborted request still runs: the prefill side keeps the arrays until pulled)."""
        sharding = self.executor.kv_sharding(self._pull_ranks.pop(req_id))
        device = min(sharding.device_set, key=lambda d: d.id)
        k, v = jax_transfer.pull(self._transfer_connection, number, shape, dtype, device)
        k, v = jax.device_put((k, v), sharding)
        return ("kv", req_id, k, v, num_blocks, time.perf_counter())

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

    # ---- the transport -------------------------------------------------------------------
    def _send_request(self, fields: dict[str, Any]) -> None:
        self.conn.send(("add", fields))

    def _send_abort(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self._pulled.pop(req_id, None)
        self.conn.send(("abort", list(request_ids)))

    def _receive(self, idle: bool) -> tuple[list[EngineCoreOutput], list[TransferredKV]]:
        first_tokens: list[EngineCoreOutput] = []
        arrived: list[TransferredKV] = []
        messages, self._held = self._held, []
        message = self._next(_IDLE_WAIT_S if idle and not messages else None)
        while message is not None:
            messages.append(message)
            message = self._next(None)
        for message in messages:
            if message[0] == "outputs":
                first_tokens.extend(message[1])
                self._stats = message[2]
            elif message[0] == "stats":
                self._stats = message[1]
            elif message[0] == "kv":
                _, req_id, k, v, num_blocks, landed = message
                arrived.append(TransferredKV(req_id, k, v, num_blocks,
                                             landed - self._pulled.pop(req_id, landed)))
        return first_tokens, arrived

    def _pull(self, request_id: str, rank: int, first_block: int, num_blocks: int) -> None:
        self._pulled[request_id] = time.perf_counter()
        self._pull_ranks[request_id] = rank
        self.conn.send(("pull", request_id, first_block, num_blocks))

    def prefill_stats(self) -> EngineStats:
        if self._stats is None:
            self._stats = self.state()["stats"]
        return self._stats

    def state(self) -> dict[str, Any]:
        """The prefill process's state now (after every message sent before): stats, requests
        holding blocks, free blocks per rank. A round trip: for tests and diagnostics."""
        self.conn.send(("state",))
        state = self._wait_for("state", 60.0)[1]
        self._stats = state["stats"]
        return state


def _child_env(prefill: DisaggregationSide, authkey: bytes) -> dict[str, str]:
    env = dict(os.environ, **prefill.env)
    env[AUTHKEY_ENV] = authkey.hex()
    if jax.default_backend() == "cpu" and "XLA_FLAGS" not in prefill.env:
        # CPU devices are virtual: give the child as many as its side uses.
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        count = max(prefill.devices) + 1
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _shut_down(process: subprocess.Popen, listener: Listener) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)
    listener.close()
