"""The host-side core (scheduler, KV-cache manager, block pool) never imports jax."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_core_does_not_import_jax():
    code = ("import sys, jaxserve.core.scheduler, jaxserve.core.kv_cache_manager, "
            "jaxserve.core.block_pool, jaxserve.core.request; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
