"""Host memory the engine may take for its CPU KV pool."""

from __future__ import annotations

import os
from pathlib import Path

# Share of the host memory available at start that the CPU KV pool takes by default (the
# host's memory is everyone's: the weights, the OS, other processes).
CPU_KV_MEMORY_FRACTION = 0.1


def available_host_bytes() -> int:
    """MemAvailable, or less where this process's cgroup (a container) has a lower limit."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(available, 0)
