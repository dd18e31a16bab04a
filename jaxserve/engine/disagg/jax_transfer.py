"""KV blocks between two processes through JAX's transfer server (`jax.experimental.transfer`):
the prefill process offers a request's gathered blocks under a number, the decode process pulls
them straight onto one of its devices, with no host copy in Python and no bytes on the control
socket (which carries only the number, shape and dtype).

Arrays cross as single-device arrays (each side's first device of the mesh involved), which
works whatever the two sides' tensor-parallel layouts are; the decode side then places them on
its rank's sharding.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)


# One server per runtime client for the life of the process, shared by every connector: a
# server is never torn down while the runtime it is registered with may still use it.
_SERVERS: dict[int, Any] = {}


def start_server(device: Any) -> Any | None:
    """The transfer server on loopback for this device's client (started on first use), or
    None where it cannot run."""
    key = id(device.client)
    if key not in _SERVERS:
        try:
            from jax.experimental import transfer

            _SERVERS[key] = transfer.start_transfer_server(device.client, "127.0.0.1:0",
                                                           ["127.0.0.1:0"])
        except Exception as e:  # noqa: BLE001 (any platform without it: the caller falls back)
            logger.info("JAX's transfer server does not start here (%s: %s)",
                        type(e).__name__, e)
            _SERVERS[key] = None
    return _SERVERS[key]


class Offers:
    """Prefill side: arrays kept for one pull each, under increasing numbers."""

    def __init__(self, server: Any):
        self.server = server
        self._numbers = itertools.count(1)

    def offer(self, k: jax.Array, v: jax.Array) -> tuple[int, tuple[int, ...], str]:
        device = next(iter(k.sharding.device_set))
        k, v = jax.device_put((k, v), device)
        number = next(self._numbers)
        self.server.await_pull(number, [k, v])
        return number, tuple(k.shape), str(k.dtype)


def pull(connection: Any, number: int, shape: tuple[int, ...], dtype: str,
         device: Any) -> tuple[jax.Array, jax.Array]:
    """Decode side: fetch an offer onto `device` (blocks until it has arrived)."""
    spec = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                sharding=jax.sharding.SingleDeviceSharding(device))
    k, v = connection.pull(number, [spec, spec])
    return k, v
