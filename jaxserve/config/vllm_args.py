"""vLLM engine arguments that jaxserve takes as they are, maps, or refuses by name.

An argument that can have no effect in JAX is accepted and said once in the log; one whose
value would ask for something jaxserve does not do is a ValueError naming it, never ignored.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# Accepted with any value: why each has no effect here.
NO_EFFECT = {
    "enforce_eager": "the step is always jit-compiled by XLA (there are no CUDA graphs)",
    "trust_remote_code": "no model code is loaded from checkpoints",
    "disable_log_stats": "jaxserve logs no periodic stats",
    "disable_log_requests": "requests are logged only with the server's --enable-log-requests",
    "swap_space": "preempted requests are recomputed, never swapped to CPU",
    "compilation_config": "XLA compiles the step; there is no torch.compile",
    "max_seq_len_to_capture": "there are no CUDA graphs",
    "disable_custom_all_reduce": "collectives are XLA's",
    "distributed_executor_backend": "one process drives all devices (SPMD)",
    "tokenizer_mode": "the checkpoint's tokenizer.json is used",
}
# Accepted only with the value that asks for nothing (vLLM's default).
ONLY_DEFAULT: dict[str, Any] = {
    "revision": None, "code_revision": None, "tokenizer_revision": None, "quantization": None,
    "kv_cache_dtype": "auto", "pipeline_parallel_size": 1, "cpu_offload_gb": 0,
    "pooler_config": None, "override_pooler_config": None,
}
# vLLM's older `task` argument, as the runner it names.
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling"}
_logged: set[str] = set()


def accept_vllm_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less vLLM's no-effect arguments, with vLLM's dtype names mapped."""
    out = {}
    for name, value in kwargs.items():
        if name in NO_EFFECT:
            if name not in _logged:
                _logged.add(name)
                logger.info("%s=%r has no effect in jaxserve: %s", name, value, NO_EFFECT[name])
        elif name in ONLY_DEFAULT:
            if value != ONLY_DEFAULT[name]:
                raise ValueError(f"{name}={value!r} is not supported by jaxserve (only "
                                 f"{ONLY_DEFAULT[name]!r})")
        elif name == "task":
            if value not in TASK_RUNNERS:
                raise ValueError(f"task={value!r} is not supported by jaxserve (one of "
                                 f"{tuple(TASK_RUNNERS)})")
            out.setdefault("runner", TASK_RUNNERS[value])
        elif name == "dtype" and value in ("float", "half"):
            out[name] = {"float": "float32", "half": "float16"}[value]
        elif name != "data_parallel_size":
            out[name] = value
    if "data_parallel_size" in kwargs:  # vLLM's; on one host it is the local size
        local = out.setdefault("data_parallel_size_local", kwargs["data_parallel_size"])
        if local != kwargs["data_parallel_size"]:
            raise ValueError(f"data_parallel_size ({kwargs['data_parallel_size']}) and "
                             f"data_parallel_size_local ({local}) differ: jaxserve runs every "
                             "replica in this process")
    return out
