"""Host KV caches on 2 MiB pages.

A CPU decode streams each request's KV pages from memory. On 4 KiB pages the hardware
prefetcher stops at every page boundary and each page costs a TLB miss, so the decode kernel
reads the same bytes 10-20% slower than on transparent huge pages. numpy and torch ask Linux for
huge pages on large arrays; XLA:CPU's allocator does not, so the engine asks for its caches once
they exist. The step donates the caches, so the buffers (and their pages) stay where they are.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterable

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+: onto huge pages now, not whenever khugepaged gets to it


def advise_huge_pages(arrays: Iterable[jax.Array]) -> int:
    """Asks Linux to back the whole 2 MiB pages inside each array's CPU buffers with huge pages;
    returns the bytes now on them. Only a hint: on another OS, with THP off, or for
    accelerator arrays it does nothing and returns 0."""
    if sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    shards = [shard.data for array in arrays for shard in array.addressable_shards
              if shard.device.platform == "cpu"]
    # A buffer still being written (the caches' zero fill is dispatched asynchronously) does
    # not collapse: madvise fails with EINVAL or EAGAIN.
    jax.block_until_ready(shards)
    collapsed = 0
    for data in shards:
        address = data.unsafe_buffer_pointer()
        start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (address + data.nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end <= start or libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            continue
        # One 2 MiB page at a time: a page that cannot move (memory too fragmented) fails
        # alone instead of the whole range.
        for page in range(start, end, HUGE_PAGE_BYTES):
            if libc.madvise(page, HUGE_PAGE_BYTES, _MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE_BYTES
    logger.debug("KV cache: %d MiB on huge pages", collapsed >> 20)
    return collapsed
