"""Where the CPU KV cache lives: the step donates it, so decoding never moves (copies) it, and
the worker puts the freshly zeroed pool onto 2 MiB pages from their first touch
(placement/huge_pages.py)."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from engine_helpers import SMALL_ENGINE, random_prompts
from jaxserve import LLMEngine, SamplingParams
from jaxserve.placement.huge_pages import HUGE_PAGE_BYTES, place_zeroed_on_huge_pages

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes_in(address: int, nbytes: int) -> int:
    """AnonHugePages of the mappings that overlap [address, address + nbytes), from smaps."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            start, end = (int(x, 16) for x in span.groups())
            overlaps = start < address + nbytes and address < end
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def needs_huge_pages() -> None:
    if not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text():
        pytest.skip("transparent huge pages are off on this machine")


def test_a_zeroed_array_comes_back_on_huge_pages_still_zero() -> None:
    needs_huge_pages()
    array = jnp.zeros((16 * HUGE_PAGE_BYTES // 4,), jnp.float32)  # 32 MiB
    address = array.unsafe_buffer_pointer()
    advised = place_zeroed_on_huge_pages([array])
    assert advised >= 15 * HUGE_PAGE_BYTES  # at most the two partial ends are left out
    assert huge_page_bytes_in(address, array.nbytes) < advised  # dropped, not yet touched
    ctypes.memset(address, 0, array.nbytes)  # a first touch, as the step's KV writes are
    assert huge_page_bytes_in(address, array.nbytes) >= advised
    assert not bool(jnp.any(array))


def test_decoding_keeps_the_kv_cache_in_place_on_huge_pages(llama, compile_cache_dir) -> None:
    needs_huge_pages()
    # 8192 blocks: 16 MiB of K and of V for the tiny Llama, so most of each is whole 2 MiB pages.
    engine = LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=compile_cache_dir,
                                        **{**SMALL_ENGINE, "num_kv_blocks": 8192})
    runner = engine.core.executor.worker.runner
    addresses = [cache.unsafe_buffer_pointer() for cache in (runner.k_cache, runner.v_cache)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(4, 5, 40, seed=41)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    for cache, address in zip((runner.k_cache, runner.v_cache), addresses, strict=True):
        assert cache.unsafe_buffer_pointer() == address
        assert huge_page_bytes_in(address, cache.nbytes) >= HUGE_PAGE_BYTES  # the pages written


def test_cpu_pool_is_a_share_of_available_memory_capped_and_overridable(
        llama, compile_cache_dir, monkeypatch) -> None:
    from jaxserve.models.llama import kv_cache_bytes_per_block
    from jaxserve.placement.host_memory import CPU_KV_MEMORY_FRACTION, available_host_bytes
    from jaxserve.runtime import worker

    assert 0 < available_host_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    args = {k: v for k, v in SMALL_ENGINE.items() if k != "num_kv_blocks"}

    def blocks(available: int, **extra: object) -> int:
        monkeypatch.setattr(worker, "available_host_bytes", lambda: available)
        engine = LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=
                                            compile_cache_dir, **args | extra)
        return engine.stats().num_kv_blocks

    cfg = LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=compile_cache_dir,
                                     **SMALL_ENGINE).core.model_config
    per_block = kv_cache_bytes_per_block(cfg, 16, jnp.float32)
    share = int(CPU_KV_MEMORY_FRACTION * 1000)  # blocks; the pool takes a power of two
    assert blocks(1000 * per_block) == 1 << (share.bit_length() - 1)
    assert blocks(1100 * per_block) == blocks(1000 * per_block)  # stable as free memory moves
    most = args["max_num_seqs"] * (args["max_model_len"] // 16) + 1  # every sequence full
    assert blocks(10**6 * per_block) == most
    assert blocks(1000 * per_block, cpu_kv_cache_space_gib=0.01) == int(0.01 * 2**30 // per_block)
    with pytest.raises(ValueError, match="KV cache budget holds 4 blocks"):
        blocks(50 * per_block)
