"""The `disaggregation` engine argument: parsed, validated and normalised (no jax here).

    {"prefill": {"devices": [0, 1, 2, 3] | "num_devices": 4, "tensor_parallel_size": 4,
                 "data_parallel_size_local": 1, "long_prefill_token_threshold": 64, ...},
     "decode": {...}, "connector": "inprocess" | "socket", "max_pending_transfers": 64,
     "kv_transport": "auto" | "jax_transfer" | "bytes"}

Each side takes its devices, its parallel sizes and per-side scheduler/cache/runner arguments;
everything else (model, dtype, block size, max_model_len, seed) is shared. It is parsed into a
`DisaggregationConfig`, which fills in every side's `devices`, `tensor_parallel_size` and
`data_parallel_size_local`; `to_dict` gives it back as the argument (for `replace`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONNECTORS = ("inprocess", "socket")
# How the socket connector moves KV: JAX's transfer server (device to device, across
# processes), raw bytes over its own socket, or the first where it starts ("auto").
KV_TRANSPORTS = ("auto", "jax_transfer", "bytes")
SIDES = ("prefill", "decode")
TOP_KEYS = frozenset({*SIDES, "connector", "max_pending_transfers", "port", "startup_timeout_s",
                      "kv_transport"})
PARALLEL_KEYS = frozenset({"devices", "num_devices", "tensor_parallel_size",
                           "data_parallel_size_local"})
# Per-side engine arguments; the rest of the engine configuration is shared by both sides.
SIDE_ENGINE_KEYS = frozenset({
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
    "max_num_partial_prefills", "enable_chunked_prefill", "scheduling_policy",
    "enable_mixed_batching", "num_kv_blocks",
    "cpu_kv_cache_space_gib", "gpu_memory_utilization", "enable_prefix_caching",
    "token_buckets", "request_buckets", "attention_backend"})
ENV_KEY = "env"  # socket connector only: extra environment of the prefill process


@dataclass(frozen=True)
class DisaggregationSide:
    devices: list[int]  # indices into jax.devices() (of its own process with "socket")
    tensor_parallel_size: int
    data_parallel_size_local: int
    engine_args: dict[str, Any] = field(default_factory=dict)  # this side's own (SIDE_ENGINE_KEYS)
    env: dict[str, str] = field(default_factory=dict)  # socket: the prefill process's extra env

    def to_dict(self) -> dict[str, Any]:
        out = {"devices": list(self.devices), "tensor_parallel_size": self.tensor_parallel_size,
               "data_parallel_size_local": self.data_parallel_size_local, **self.engine_args}
        return out | ({ENV_KEY: dict(self.env)} if self.env else {})


@dataclass(frozen=True)
class DisaggregationConfig:
    prefill: DisaggregationSide
    decode: DisaggregationSide
    connector: str = "inprocess"
    kv_transport: str = "auto"
    max_pending_transfers: int = 64  # requests holding prefill blocks before prefilling pauses
    port: int = 0
    startup_timeout_s: float = 300.0

    def side(self, name: str) -> DisaggregationSide:
        return self.prefill if name == "prefill" else self.decode

    def to_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "connector": self.connector, "kv_transport": self.kv_transport,
                "max_pending_transfers": self.max_pending_transfers, "port": self.port,
                "startup_timeout_s": self.startup_timeout_s}


def normalize_disaggregation(value: Any, *, coordinator_address: str | None,
                             devices: list[int] | None) -> DisaggregationConfig:
    """The argument in normal form. `coordinator_address` and `devices` are the engine's own
    arguments (both must be unset); config.py then validates each side's `side_config`."""
    if isinstance(value, DisaggregationConfig):
        value = value.to_dict()
    if isinstance(value, str):
        value = _load_text(value)
    if not isinstance(value, dict):
        raise ValueError(f"disaggregation must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - TOP_KEYS)
    if unknown:
        raise ValueError(f"disaggregation: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(TOP_KEYS))})")
    if coordinator_address is not None:
        raise ValueError("disaggregation: multi-host runs (coordinator_address) are not "
                         "supported")
    if devices is not None:
        raise ValueError("disaggregation: give devices per side (prefill.devices, "
                         "decode.devices), not devices")
    connector = value.get("connector", "inprocess")
    if connector not in CONNECTORS:
        raise ValueError(f"disaggregation.connector must be one of {CONNECTORS}, "
                         f"got {connector!r}")
    kv_transport = value.get("kv_transport", "auto")
    if kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"disaggregation.kv_transport must be one of {KV_TRANSPORTS}, "
                         f"got {kv_transport!r}")
    if kv_transport != "auto" and connector != "socket":
        raise ValueError("disaggregation.kv_transport applies to the socket connector only "
                         f"(connector is {connector!r})")
    sides = {name: _side(value.get(name, {}), name, connector) for name in SIDES}
    _assign_devices(sides, shared=connector == "inprocess")
    out = DisaggregationConfig(
        **{name: DisaggregationSide(**side) for name, side in sides.items()},
        connector=connector, kv_transport=kv_transport,
        max_pending_transfers=_positive_int(value, "max_pending_transfers", 64),
        port=_positive_int(value, "port", 0, minimum=0),
        startup_timeout_s=_positive_number(value, "startup_timeout_s", 300.0))
    if out.port > 65535:
        raise ValueError(f"disaggregation.port must be <= 65535, got {out.port}")
    return out


def _load_text(text: str) -> Any:
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
        text = path.read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"disaggregation: not valid JSON/YAML: {e}") from e


def _side(raw: Any, name: str, connector: str) -> dict[str, Any]:
    where = f"disaggregation.{name}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    allowed = PARALLEL_KEYS | SIDE_ENGINE_KEYS
    if name == "prefill" and connector == "socket":
        allowed = allowed | {ENV_KEY}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}")
    dp = _positive_int(raw, "data_parallel_size_local", 1, where)
    devices, count = raw.get("devices"), raw.get("num_devices")
    if devices is not None:
        if (not isinstance(devices, list) or not devices
                or any(not _is_int(d) or d < 0 for d in devices)
                or len(set(devices)) != len(devices)):
            raise ValueError(f"{where}.devices must be a non-empty list of distinct device "
                             f"indices, got {devices!r}")
        if count is not None and count != len(devices):
            raise ValueError(f"{where}: num_devices {count!r} != len(devices) {len(devices)}")
        count = len(devices)
    elif count is not None:
        count = _positive_int(raw, "num_devices", 1, where)
    tp = _positive_int(raw, "tensor_parallel_size", max(1, (count or dp) // dp), where)
    count = tp * dp if count is None else count
    if tp * dp != count:
        raise ValueError(f"{where}: tensor_parallel_size {tp} x data_parallel_size_local {dp} "
                         f"= {tp * dp} must equal its number of devices ({count})")
    env = raw.get(ENV_KEY, {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise ValueError(f"{where}.env must map names to strings, got {env!r}")
    return {"engine_args": {k: v for k, v in raw.items() if k in SIDE_ENGINE_KEYS},
            "devices": devices, "num_devices": count, "tensor_parallel_size": tp,
            "data_parallel_size_local": dp, "env": dict(env)}


def _assign_devices(sides: dict[str, dict[str, Any]], shared: bool) -> None:
    """Sides without explicit devices get the lowest free indices, prefill first. In one
    process (shared) the two sides must not overlap; in two processes each counts from 0."""
    if shared:
        p, d = sides["prefill"]["devices"], sides["decode"]["devices"]
        if p is not None and d is not None and set(p) & set(d):
            raise ValueError(f"disaggregation: prefill devices {p} and decode devices {d} "
                             f"overlap (device {sorted(set(p) & set(d))[0]})")
    taken = {i for s in sides.values() if s["devices"] for i in s["devices"]} if shared else set()
    for side in sides.values():
        if side["devices"] is None:
            free = (i for i in range(len(taken) + side["num_devices"] + 1) if i not in taken)
            side["devices"] = [next(free) for _ in range(side["num_devices"])]
            if shared:
                taken |= set(side["devices"])
        del side["num_devices"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(raw: dict[str, Any], key: str, default: int, where: str = "disaggregation",
                  minimum: int = 1) -> int:
    value = raw.get(key, default)
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_number(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"disaggregation.{key} must be a positive number, got {value!r}")
    return float(value)
