"""Deviceless TPU compile (real Mosaic + XLA:TPU via libtpu) of the TPU kernel, run in the separate
.venv-tpu (scripts/setup_compile_venvs.sh tpu) because libtpu adds ~700 MB."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from target_compilers import target_compiler_env

REPO = Path(__file__).resolve().parents[2]
TPU_PYTHON = REPO / ".venv-tpu" / "bin" / "python"
TOPOLOGIES = ("v5e:2x2", "v6e:2x2")
GOOD = ("mixed-f32", "mixed-bf16", "mixed-f32-d64-window-softcap", "mixed-bf16-bs128-gqa4")
BAD = ("rows-over-vmem", "block-table-over-smem")


@pytest.mark.slow
@pytest.mark.skipif(not TPU_PYTHON.exists(),
                    reason=".venv-tpu absent: run scripts/setup_compile_venvs.sh tpu")
def test_tpu_kernel_compiles_for_v5e_and_v6e_and_bad_tiles_do_not() -> None:
    env = target_compiler_env(PYTHONPATH=str(REPO))
    proc = subprocess.run([str(TPU_PYTHON), str(REPO / "scripts" / "check_tpu_compile.py"),
                           "--topologies", *TOPOLOGIES],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    for topology in TOPOLOGIES:
        for case in GOOD:
            assert re.search(rf"^OK +{re.escape(topology)} {case}: compiled", out, re.M), \
                f"{topology} {case} did not compile:\n{out}"
        for case in BAD:
            assert re.search(rf"^REFUSED +{re.escape(topology)} {case}: tiling check", out, re.M), \
                f"{topology} {case} passed our tiling check:\n{out}"
            assert re.search(rf"^REJECTED +{re.escape(topology)} {case}: ", out, re.M), \
                f"{topology} {case} was not rejected by the TPU toolchain:\n{out}"
    assert "check_tpu_compile: PASS" in out and proc.returncode == 0, out + proc.stderr[-3000:]
