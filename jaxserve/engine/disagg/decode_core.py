"""The disaggregated engine as the user holds it: the decode side's EngineCore, with a KV
connector to a prefill engine on other devices of this process or in a child process."""

from __future__ import annotations

import jax

from jaxserve.config import EngineConfig, side_config
from jaxserve.config.disaggregation import DisaggregationConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.kv_connector import KVConnector
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.loader import load_configured
from jaxserve.placement.kv_blocks import transfer_heads


def make_decode_core(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineCore:
    settings = config.parallel.disaggregation
    if settings is None:
        raise ValueError("disaggregation must be set for a disaggregated engine")
    if settings.connector == "inprocess":
        _check_device_count(settings)
    m = config.model
    loaded = loaded or load_configured(m)
    decode_config = side_config(config, settings, "decode")
    connector = _make_connector(config, settings, loaded, decode_config)
    try:  # EngineCore refuses a pool that cannot hold one sequence: say which side's
        return EngineCore(decode_config, loaded, connector=connector)
    except ValueError as exc:
        connector.close()
        raise ValueError(f"disaggregation.decode: {exc}") from exc


def _make_connector(config: EngineConfig, settings: DisaggregationConfig, loaded: LoadedModel,
                    decode_config: EngineConfig) -> KVConnector:
    prefill_config = side_config(config, settings, "prefill")
    heads = transfer_heads(loaded.config.num_kv_heads,
                           prefill_config.parallel.tensor_parallel_size,
                           decode_config.parallel.tensor_parallel_size)
    if settings.connector == "inprocess":
        from jaxserve.engine.disagg.connector import InProcessConnector

        return InProcessConnector(prefill_config, loaded, heads, settings.max_pending_transfers)
    from jaxserve.engine.disagg.socket_connector import SocketConnector

    return SocketConnector(prefill_config, settings, heads)


def _check_device_count(settings: DisaggregationConfig) -> None:
    used = settings.prefill.devices + settings.decode.devices
    if max(used) >= jax.device_count():
        raise ValueError(f"disaggregation needs devices {sorted(used)} (prefill "
                         f"{settings.prefill.devices}, decode {settings.decode.devices}), but "
                         f"only {jax.device_count()} are present")
