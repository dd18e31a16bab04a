"""vLLM's sleep mode and in-place weight updates: asleep, the devices hold neither weights nor
KV cache; after wake_up or update_weights the engine gives the tokens an engine started on
those weights gives, and nothing compiles (counted by the engine and by JAX itself).

One engine for the module: TP 4 over 2 KV heads (each duplicated on two devices) with the
layers scanned, so the weights come back sharded and an update writes into stacked arrays."""

from __future__ import annotations

import asyncio

import jax
import pytest
from safetensors.numpy import load_file

from engine_helpers import backend_compiles, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_llm import AsyncLLM

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (forced) CPU devices")
ENGINE = dict(tensor_parallel_size=4, attention_backend="xla", scan_layers=True,
              max_model_len=128, num_kv_blocks=72, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=[16, 64], request_buckets=[4])
PROMPTS = random_prompts(4, 17, 40, seed=53)  # each fills a block: a copy of it hits the cache
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=7)


def tokens(llm: LLM) -> list[list[int]]:
    """Greedy, then seeded, tokens of each prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2],
                        [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def cached_blocks(llm: LLM) -> int:
    return len(llm.engine.core.scheduler.kv.block_pool.cached_block_hash_to_block)


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    """Two checkpoints of one architecture, random weights of two seeds."""
    return [hf_checkpoint("llama", num_heads=8, num_kv_heads=2, seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def engine(checkpoints, compile_cache_dir):
    """The engine on the first checkpoint and its tokens (which compile what they need)."""
    llm = LLM(str(checkpoints[0]), compilation_cache_dir=compile_cache_dir, **ENGINE)
    return llm, tokens(llm)


def test_asleep_the_device_holds_nothing_and_awake_the_tokens_are_the_same(engine):
    llm, expected = engine
    runner = llm.engine.core.executor.worker.runner
    awake = llm.stats()
    assert awake.sleep_level == 0 and awake.weight_bytes > 0 and awake.kv_cache_bytes > 0
    with backend_compiles() as compiles:
        for level, wake_ups in ((1, [["weights"], ["kv_cache"]]), (2, [None])):
            arrays = jax.tree.leaves((runner.params, runner.k_cache, runner.v_cache))
            shardings = [a.sharding for a in arrays]
            assert cached_blocks(llm) > 0
            llm.sleep(level=level)
            stats = llm.stats()
            assert llm.is_sleeping() and stats.sleep_level == level
            assert stats.weight_bytes == stats.kv_cache_bytes == 0
            assert all(a.is_deleted() for a in arrays)
            assert not any(a.shape == runner.k_cache.shape for a in jax.live_arrays())
            assert cached_blocks(llm) == 0  # the KV it named is gone
            with pytest.raises(ValueError, match=r"asleep: call wake_up\(\)"):
                llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
            for tags in wake_ups:
                llm.wake_up(tags=tags)
                stats, half_awake = llm.stats(), tags == ["weights"]
                assert llm.is_sleeping() == half_awake
                assert stats.sleep_level == (level if half_awake else 0)
                assert stats.weight_bytes == awake.weight_bytes
                assert stats.kv_cache_bytes == (0 if half_awake else awake.kv_cache_bytes)
            arrays = jax.tree.leaves((runner.params, runner.k_cache, runner.v_cache))
            assert [a.sharding for a in arrays] == shardings
            assert tokens(llm) == expected
        assert not compiles
    assert llm.stats().num_compilations == awake.num_compilations


def test_bad_calls_raise_naming_the_field_and_leave_the_engine_as_it_was(engine, checkpoints):
    llm, expected = engine
    other = load_file(str(checkpoints[1] / "model.safetensors"))
    embed, wk = "model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"
    # A good weight first: an error in a later one writes neither.
    with pytest.raises(ValueError, match="'model.layers.9.self_attn.k_proj.weight' is not a"):
        llm.update_weights([(embed, other[embed]),
                            ("model.layers.9.self_attn.k_proj.weight", other[wk])])
    with pytest.raises(ValueError, match=rf"'{wk}' has shape \(64, 16\), expected \(16, 64\)"):
        llm.update_weights({embed: other[embed], wk: other[wk].T})
    with pytest.raises(ValueError, match="level must be 1 or 2, got 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match=r"tags must be a list of \['weights', 'kv_cache'\]"):
        llm.wake_up(tags=["weights", "gpu"])
    llm.engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    for call in (lambda: llm.sleep(), lambda: llm.update_weights({embed: other[embed]})):
        with pytest.raises(ValueError, match="1 requests are unfinished"):
            call()
    llm.engine.abort_request("busy")
    assert not llm.is_sleeping()
    assert tokens(llm) == expected


def test_updated_weights_give_the_tokens_of_an_engine_on_them(engine, checkpoints,
                                                               compile_cache_dir):
    llm, expected = engine
    new = load_file(str(checkpoints[1] / "model.safetensors"))
    names = sorted(new)
    # Half the tensors (some layers of each stacked weight), then the rest as jax arrays.
    halves = [[(name, new[name]) for name in names[::2]],
              {name: jax.device_put(new[name]) for name in names[1::2]}]
    compiled = llm.stats().num_compilations
    with backend_compiles() as compiles:
        for half in halves:
            llm.update_weights(half)
        assert cached_blocks(llm) == 0  # computed by the old weights
        got = tokens(llm)
    assert not compiles and llm.stats().num_compilations == compiled
    assert got != expected
    assert got[:len(PROMPTS)] == hf_greedy(checkpoints[1], PROMPTS, GREEDY.max_tokens)
    assert got == tokens(LLM(str(checkpoints[1]), compilation_cache_dir=compile_cache_dir,
                             **ENGINE))
    llm.update_weights(load_file(str(checkpoints[0] / "model.safetensors")).items())
    assert tokens(llm) == expected


def test_collective_rpc_calls_every_worker(engine):
    llm, expected = engine
    assert llm.collective_rpc(lambda worker, tag: worker.held_bytes[tag],
                              args=("weights",)) == [llm.stats().weight_bytes]
    assert llm.collective_rpc("fingerprint") == [llm.engine.core.executor.worker.fingerprint()]
    for bad, words in ((dict(method="held_bytes"), "no public method 'held_bytes'"),
                       (dict(method="_read_compiled"), "no public method"),
                       (dict(method=5), "method must be a worker method's name or a callable"),
                       (dict(method="fingerprint", timeout=5.0), "timeout: ")):
        with pytest.raises(ValueError, match=words):
            llm.collective_rpc(**bad)
    assert tokens(llm) == expected


def test_async_llm_sleeps_and_wakes_up(engine):
    """Last: the engine's thread becomes its only user."""
    llm, expected = engine
    async_llm = AsyncLLM.from_engine(llm.engine)

    async def run() -> list[int]:
        assert await async_llm.collective_rpc(lambda worker: worker.sleep_level) == [0]
        await async_llm.sleep(level=1)
        assert await async_llm.is_sleeping()
        await async_llm.wake_up()
        assert not await async_llm.is_sleeping()
        async for out in async_llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY):
            final = out
        return final.outputs[0].token_ids

    try:
        assert asyncio.run(run()) == expected[0]
    finally:
        async_llm.shutdown()
