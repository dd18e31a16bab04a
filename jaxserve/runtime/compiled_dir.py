"""Executables built ahead of time: a directory of serialized programs and a manifest.

`jaxserve compile` writes every program the engine's warm-up would build (each model-step
bucket, each sampler variant) and the one that allocates the KV pool; an engine given
`compiled_dir` loads them and calls them directly, compiling nothing. The manifest's
fingerprint (jax/jaxlib/plugin versions, target, model config and the draft model's, every
engine argument that affects shapes or sharding, the resolved plan: KV pool size, buckets,
dtype, mesh) must equal the engine's
own; each file's sha256 is checked before it is unpickled, so a corrupt or truncated file is
refused, never loaded. Load only directories you built: files are pickles.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pickle
import queue
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from jaxserve.config import EngineConfig
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.programs.resolved import ResolvedPlan

MANIFEST = "manifest.json"
KV_INIT = ("kv_init", None)  # the program that allocates the zeroed KV pool
FORMAT = 8  # the programs' arguments (2: the last step's samples with their accepted drafts;
# 3: the LM head vocab-major, [V, D]; 4: the sampler returns the host's ids, the model step no
# drafts, and a tied head on the native CPU path is packed; 5: the TPU kernel writes the KV
# cache, and the step's sample rows come back replicated; 6: the `cpu` backend's weights as
# loaded, no longer fused and packed for the deleted native matmul; 7: the engine's resolved
# plan in the fingerprint; 8: the plain step takes no draft arguments, a speculative step its
# drafter's weights and state, and both return named outputs)
# Engine arguments that change a program's shapes, sharding or code.
SHAPE_ARGS = ("dtype", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
              "token_buckets", "request_buckets", "attention_backend", "scan_layers",
              "tensor_parallel_size", "max_logprobs", "collective_matmul_min_tokens")
_PLUGINS = ("jaxlib", "libtpu", "jax-cuda13-plugin", "jax-cuda12-plugin")


class CompiledDirError(ValueError):
    """The directory cannot be used by this engine; the message names why."""


def _versions() -> dict[str, str]:
    out = {"jax": jax.__version__}
    for name in _PLUGINS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def fingerprint(config: EngineConfig, model: LlamaConfig, plan: ResolvedPlan, *,
                device_kind: str, draft: LlamaConfig | None = None,
                versions: bool = True) -> dict[str, Any]:
    """Everything the programs depend on, JSON-normalised so a saved copy compares equal.
    `draft`: the draft model's config as placed (speculative draft_model). Models enter by
    their architecture, not their path or weights, which the programs take as inputs."""
    args = config.to_kwargs()
    # How the pool was sized is not a program's: a directory's pool is taken as given.
    facts = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
             if f.name not in ("platform", "kv_block_bytes")} | {"dtype": plan.dtype.name}
    fp = {"format": FORMAT, "platform": plan.platform, "device_kind": device_kind,
          "model": dataclasses.asdict(model), "plan": facts,
          **{name: args[name] for name in SHAPE_ARGS}}
    spec = config.scheduler.speculative_config  # drafts shape the programs: k, who drafts
    fp["speculative_config"] = None if spec is None else spec.to_dict() | {"model": None}
    fp["draft_model"] = None if draft is None else dataclasses.asdict(draft)
    if versions:
        fp["versions"] = _versions()
    return json.loads(json.dumps(fp))


def _differences(saved: dict[str, Any], ours: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(ours)):
        a, b = saved.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: built for {a!r}, this engine has {b!r}")
    return out


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CompiledDirError(f"compiled_dir: cannot read {MANIFEST}: {e}") from None
    if manifest.get("fingerprint", {}).get("format") != FORMAT:
        raise CompiledDirError(f"compiled_dir: {MANIFEST} is not format {FORMAT}")
    return manifest


def save(directory: str | Path, programs: dict[Any, Any], fp: dict[str, Any],
         left: dict[Any, str] | None = None) -> Path:
    """programs: {key: jax.stages.Compiled}; key is (kind, PackedLayout). `left`: programs the
    target's compiler could not build without the device, and why (the engine compiles them
    at warm-up); listed in the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (key, compiled) in enumerate(programs.items()):
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = pickle.dumps((key, payload, in_tree, out_tree))
        name = f"{i:04d}-{key[0]}.bin"
        (directory / name).write_bytes(blob)
        entries.append({"file": name, "kind": key[0], "bytes": len(blob),
                        "sha256": hashlib.sha256(blob).hexdigest()})
    manifest = {"fingerprint": fp, "programs": entries,
                "left_for_the_device": [{"kind": key[0], "why": why}
                                        for key, why in (left or {}).items()]}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return directory


class LoadedPrograms:
    """The programs of a directory by key, each deserialised onto the devices on first use or
    ahead of it on a background thread (`load_in_background`): a directory holds every bucket's
    programs, a start needs a few, and a 30-layer step program takes about a second to load."""

    def __init__(self, saved_fingerprint: dict[str, Any],
                 payloads: dict[Any, tuple[bytes, Any, Any]], devices: list[Any]) -> None:
        self.saved_fingerprint = saved_fingerprint
        self._payloads = payloads
        self._devices = devices
        self._loaded: dict[Any, Any] = {}
        self._queued: dict[Any, Future[Any]] = {}
        self._loader: threading.Thread | None = None
        self._todo: queue.SimpleQueue[tuple[Any, Future[Any]] | None] = queue.SimpleQueue()

    def __contains__(self, key: Any) -> bool:
        return key in self._payloads

    def __len__(self) -> int:
        return len(self._payloads)

    def check(self, fp: dict[str, Any], directory: str | Path) -> None:
        """CompiledDirError naming what differs unless the directory was built for exactly the
        engine whose fingerprint is `fp`; then nothing more is loaded."""
        diffs = _differences(self.saved_fingerprint, fp)
        if diffs:
            self.stop_loading()
            raise CompiledDirError(f"compiled_dir {Path(directory).name} was built for another "
                                   "engine: " + "; ".join(diffs[:5]))

    def load_in_background(self, keys: list[Any]) -> None:
        """Deserialise these programs one after another on a background thread (deserialising
        lets go of the GIL), so the engine can read its weights meanwhile; a later call queues
        more behind them. A daemon thread, so a process can exit with programs still queued;
        the exit waits for the one being deserialised (`stop_loading`), as a thread killed
        inside XLA aborts the process."""
        for key in dict.fromkeys(keys):
            if key in self._payloads and key not in self._loaded and key not in self._queued:
                self._queued[key] = future = Future()
                self._todo.put((key, future))
        if self._loader is None:
            self._loader = threading.Thread(target=self._load_queued, daemon=True,
                                            name="jaxserve-programs")
            self._loader.start()
            atexit.register(_stop_loading, weakref.ref(self))

    def _load_queued(self) -> None:
        # Niced: the weights being read and the engine's first steps come first.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while (item := self._todo.get()) is not None:
            key, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._deserialize(key))
                except Exception as e:  # noqa: BLE001 - raised where the program is needed
                    future.set_exception(e)

    def stop_loading(self) -> None:
        """Cancel the programs still queued for the background thread and wait for the one it
        is deserialising."""
        for future in self._queued.values():
            future.cancel()
        if self._loader is not None and self._loader.is_alive():
            self._todo.put(None)
            self._loader.join()

    def loading_or_loaded(self, key: Any) -> bool:
        """Whether `key` is ready or being deserialised now: `get` waits for no whole load."""
        queued = self._queued.get(key)
        return key in self._loaded or queued is not None and (
            queued.running() or queued.done() and not queued.cancelled())

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self._payloads:
            return default
        if key not in self._loaded:
            queued = self._queued.pop(key, None)
            # One the background thread has started or finished is waited for; one still in
            # its queue is loaded here, ahead of those before it.
            self._loaded[key] = (self._deserialize(key) if queued is None or queued.cancel()
                                 else queued.result())
        return self._loaded[key]

    def pop(self, key: Any, default: Any = None) -> Any:
        program = self.get(key, default)
        self._payloads.pop(key, None)
        self._loaded.pop(key, None)
        return program

    def _deserialize(self, key: Any) -> Any:
        payload, in_tree, out_tree = self._payloads[key]
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                         execution_devices=self._devices)


def _stop_loading(programs: weakref.ref[LoadedPrograms]) -> None:
    alive = programs()
    if alive is not None:
        alive.stop_loading()


def read_programs(directory: str | Path, devices: list[Any]) -> LoadedPrograms:
    """The directory's programs, for `devices` (one rank's mesh, in order), if every file is
    whole; else CompiledDirError naming what is damaged. Whether they were built for this
    engine is `LoadedPrograms.check`'s to say."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    payloads = {}
    for entry in manifest["programs"]:
        path = directory / entry["file"]
        blob = path.read_bytes() if path.is_file() else b""
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            raise CompiledDirError(f"compiled_dir: {entry['file']} is missing, truncated or "
                                   "corrupt (sha256 differs from the manifest)")
        key, *payload = pickle.loads(blob)  # noqa: S301 - hash-checked
        payloads[key] = tuple(payload)
    return LoadedPrograms(manifest["fingerprint"], payloads, devices)
