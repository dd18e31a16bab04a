"""Two processes on 127.0.0.1 run one engine with jax.distributed (TP over both processes'
devices) and produce the same tokens as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine_helpers import random_prompts

SCRIPT = Path(__file__).with_name("multihost_main.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model: str, num_processes: int, devices_per_process: int, tp: int, out: Path,
         prompts: list[list[int]], tmp: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    port = _free_port()
    logs = [tmp / f"log{i}.txt" for i in range(num_processes)]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), model, str(port), str(num_processes),
                               str(i), str(tp), str(out), json.dumps(prompts)], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    deadline = time.monotonic() + 300
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            assert not failed, logs[failed[0]].read_text()[-3000:]  # a peer would wait forever
            assert time.monotonic() < deadline, "multi-host run timed out"
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log.read_text()[-3000:]

def test_two_processes_give_the_tokens_of_one(hf_checkpoint, tmp_path):
    model = str(hf_checkpoint("llama", num_heads=8, num_kv_heads=4))
    prompts = random_prompts(5, 3, 40, seed=71)
    _run(model, 1, 4, 4, tmp_path / "one.json", prompts, tmp_path)
    _run(model, 2, 2, 4, tmp_path / "two.json", prompts, tmp_path)
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert len(one) == 5 and all(len(t) == 10 for t in one)
    assert two == one
