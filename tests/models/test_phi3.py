"""Phi-3 against HF transformers on tiny random checkpoints built with `save_pretrained` (fp32,
sliding windows of 24 tokens): logits, greedy tokens through the engine, LongRoPE on both sides
of original_max_position_embeddings (48), and the fused qkv_proj / gate_up_proj tensors read and
written back."""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from engine_helpers import (CHUNKED_ASYNC, FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks,
                            greedy_with_a_cached_prefix, hf_greedy, random_prompts)
from jaxserve import LLM, SamplingParams
from jaxserve.layers.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from jaxserve.models.checkpoint_io import save_converted
from jaxserve.models.llama import init_kv_cache
from jaxserve.models.loader import load_model
from jaxserve.models.phi3 import Phi3, Phi3Config
from jaxserve.models.registry import family_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ORIGINAL = 48  # phi3_longrope's original_max_position_embeddings
BLOCK = 16


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef: nnx.GraphDef, backend: AttentionBackend, state: nnx.State,
             ids: jax.Array, md: AttentionMetadata, k_cache: jax.Array,
             v_cache: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    hidden, _, _ = model(ids, md, k_cache, v_cache, backend)
    return model.compute_logits(hidden)


def ragged_logits(path, prompts: list[list[int]], config: Phi3Config | None = None,
                  **model_args: bool) -> list[np.ndarray]:
    """Each prompt's logits at every position, all prompts in one call: a ragged batch, each
    request in blocks of its own."""
    loaded = load_model(str(path))
    config = config or loaded.config
    model = family_of(config).model(config, loaded.params, **model_args)
    graphdef, state = nnx.split(model)
    lens = [len(p) for p in prompts]
    blocks = [-(-n // BLOCK) for n in lens]
    table = np.zeros((len(prompts), max(blocks)), np.int32)
    for r, n in enumerate(blocks):  # block 0 stays unused
        table[r, :n] = 1 + sum(blocks[:r]) + np.arange(n)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    req = np.repeat(np.arange(len(prompts)), lens)
    md = AttentionMetadata(
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(table[req, pos // BLOCK] * BLOCK + pos % BLOCK),
        query_start_loc=jnp.asarray(np.cumsum([0] + lens), jnp.int32),
        seq_lens=jnp.asarray(lens, jnp.int32), block_tables=jnp.asarray(table))
    k_cache, v_cache = init_kv_cache(config, 1 + sum(blocks), BLOCK)
    logits = np.asarray(_forward(graphdef, get_attention_backend("xla"), state,
                                 jnp.asarray(np.concatenate(prompts), jnp.int32), md, k_cache,
                                 v_cache))
    return np.split(logits, np.cumsum(lens)[:-1])


def hf_logits(path, ids: list[int]) -> np.ndarray:
    import torch
    from hf_checkpoints import hf_model

    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].numpy()


def prompts_around_the_original_length() -> list[list[int]]:
    """70 tokens (the long factors from the prompt on), 30 (decodes pass 48), 10 (never do)."""
    rng = np.random.default_rng(21)
    return [rng.integers(2, 320, size=n).tolist() for n in (70, 30, 10)]


@pytest.mark.parametrize("rotary_lookup,scan_layers", [(False, False), (True, False),
                                                       (False, True)])
@pytest.mark.parametrize("kind", ["phi3", "phi3_longrope"])
def test_logits_of_a_ragged_batch_match_hf_forward(hf_checkpoint, kind, rotary_lookup,
                                                   scan_layers):
    """One call holds a prompt past original_max_position_embeddings and one within it: each
    request rotates by its own factor set, as HF's forward of that prompt alone does."""
    path = hf_checkpoint(kind)
    prompts = prompts_around_the_original_length()[:2]
    ours = ragged_logits(path, prompts, rotary_lookup=rotary_lookup, scan_layers=scan_layers)
    for got, ids in zip(ours, prompts):
        np.testing.assert_allclose(got, hf_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind,change", [
    ("phi3", {"sliding_window": None}),
    ("phi3_longrope", {"sliding_window": None}),
    ("phi3_longrope", {"long_factor": "short_factor"}),  # short factors past 48 too
    ("phi3_longrope", {"short_factor": "long_factor"}),  # long factors within 48 too
    ("phi3_longrope", {"max_position_embeddings": ORIGINAL}),  # cos and sin unscaled
])
def test_each_phi3_feature_moves_the_logits(hf_checkpoint, kind, change):
    """What the checkpoints exercise: without it the logits move far more than our error."""
    path = hf_checkpoint(kind)
    config = load_model(str(path)).config
    change = {k: getattr(config, v) if isinstance(v, str) else v for k, v in change.items()}
    prompts = prompts_around_the_original_length()[:2]
    refs = [hf_logits(path, ids) for ids in prompts]
    ours = ragged_logits(path, prompts, rotary_lookup=True)
    without = ragged_logits(path, prompts, config.replace(**change), rotary_lookup=True)
    error = max(np.abs(o - r).max() for o, r in zip(ours, refs))
    assert max(np.abs(w - r).max() for w, r in zip(without, refs)) > 100 * error


def generate(path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    llm = LLM(str(path), **(SMALL_ENGINE | engine))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_equal_hf_generate(hf_checkpoint, compile_cache_dir):
    """Chunked prefill (prompts over one step's 32 tokens), a cached prefix (prefix caching)
    and async scheduling on the default CPU backend, prompts sliding past the window of 24."""
    path = hf_checkpoint("phi3")
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | CHUNKED_ASYNC))
    prompts, got = greedy_with_a_cached_prefix(llm, GREEDY, seed=31)
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_greedy_tokens_equal_hf_when_requests_are_preempted(hf_checkpoint, compile_cache_dir):
    path = hf_checkpoint("phi3")
    prompts = random_prompts(8, 30, 60, seed=33)
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | {"num_kv_blocks": 14}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)


def hf_greedy_keeping_the_cache(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's forward, greedy, one token at a time over one cache: its rotary rule (the long
    factors in a forward whose sequence passes original_max_position_embeddings) without
    `generate`'s re-prefill of the whole sequence when it first passes it."""
    import torch
    from hf_checkpoints import hf_model
    from transformers import DynamicCache

    model = hf_model(path)
    cache = DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out.append(int(model(ids, cache=cache, use_cache=True).logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("engine", [
    pytest.param({}, id="cpu-rotary-tables"),
    # TP 2 shards Phi-3's (separate) params as Llama's; Gemma's TP 2 engine runs by default
    pytest.param({"tensor_parallel_size": 2}, id="tp2", marks=pytest.mark.full),
    pytest.param({"attention_backend": "pallas_interpret"} | FEW_BUCKETS, id="pallas_interpret"),
])
def test_longrope_greedy_tokens_equal_hf_across_the_original_length(hf_checkpoint,
                                                                    compile_cache_dir, engine):
    """Every prompt in one step, unchunked: a prompt past 48 tokens rotates by the long factors
    throughout and one that stays under 48 by the short ones, token for token HF's `generate`.
    A prompt whose decodes pass 48 switches to the long factors from that step on, keeping the
    KV of its earlier tokens, as HF's forward over its cache does (HF's `generate` re-prefills
    the whole sequence at that step instead: not done here)."""
    path = hf_checkpoint("phi3_longrope")
    long_prompt, crossing, short = prompts_around_the_original_length()
    assert len(long_prompt) > ORIGINAL > len(crossing) > ORIGINAL - GREEDY.max_tokens
    got = generate(path, [long_prompt, crossing, short], compilation_cache_dir=compile_cache_dir,
                   enable_chunked_prefill=False, **engine)
    assert [got[0], got[2]] == hf_greedy(path, [long_prompt, short], GREEDY.max_tokens)
    assert got[1] == hf_greedy_keeping_the_cache(path, crossing, GREEDY.max_tokens)


LONGROPE = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
BASE = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "original_max_position_embeddings": 48,
        "sliding_window": 24, "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
        "rope_scaling": {"type": "longrope"} | LONGROPE}


def test_both_config_formats_give_the_same_longrope_config():
    """config.json as Phi-3's checkpoints have it (`rope_scaling`, "su" in the first ones) and
    as transformers 5 writes it (`rope_parameters`, theta inside)."""
    old = Phi3Config.from_hf_dict(BASE)
    assert (old.short_factor, old.long_factor) == ((1.0,) * 8, (2.0,) * 8)
    assert (old.original_max_position_embeddings, old.sliding_window) == (48, 24)
    su = BASE | {"rope_scaling": {"type": "su"} | LONGROPE}
    new = {k: v for k, v in BASE.items() if k not in ("rope_scaling", "rope_theta")} | {
        "rope_parameters": {"rope_type": "longrope", "type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 1.0,
                            "original_max_position_embeddings": 48} | LONGROPE}
    inside = {k: v for k, v in new.items() if k != "original_max_position_embeddings"}
    for cfg in (su, new, inside):
        assert Phi3Config.from_hf_dict(cfg) == old
    assert Phi3Config.from_hf_dict(old.to_hf_dict()) == old
    assert old.with_hf_overrides({"original_max_position_embeddings": 64}) == \
        old.replace(original_max_position_embeddings=64)
    plain = {k: v for k, v in new.items() if k != "rope_parameters"} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}
    assert Phi3Config.from_hf_dict(plain).short_factor is None
    assert Phi3Config.from_hf_dict(plain).rope_theta == 1e5


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8}},
     r"short_factor must be a list of head_dim / 2 = 8 numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [2.0] * 7 + [0.0]}}, r"long_factor must hold finite "
                                                           r"numbers > 0"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}},
     r"short_factor and long_factor \(LongRoPE\) must both be given"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling\.rope_type must be "
                                                          r"'longrope' or 'default'"),
    ({"rope_scaling": {"type": "longrope", "attention_factor": 1.2} | LONGROPE},
     r"rope_scaling\.attention_factor is not supported"),
    ({"partial_rotary_factor": 0.75}, r"partial_rotary_factor must be 1 .*Phi-4-mini"),
    ({"rope_scaling": {"type": "longrope", "partial_rotary_factor": 0.5} | LONGROPE},
     r"partial_rotary_factor must be 1"),
    ({"hidden_act": "gelu"}, r"hidden_act must be 'silu', got 'gelu'"),
    ({"original_max_position_embeddings": 0}, r"original_max_position_embeddings must be an "
                                              r"integer in \[2, "),
    ({"attention_bias": True}, r"attention_bias must be false"),
])
def test_a_bad_phi3_config_names_the_field(change, message):
    with pytest.raises(ValueError, match=r"model config: " + message):
        Phi3Config.from_hf_dict(BASE | change)


def test_a_bad_phi3_checkpoint_config_is_a_clear_error_at_load(hf_checkpoint, tmp_path):
    path = tmp_path / "bad"
    shutil.copytree(hf_checkpoint("phi3_longrope"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["long_factor"][:-1]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model config: long_factor must be a list of "
                                         r"head_dim / 2 = 8 numbers"):
        load_model(str(path))


def test_fused_names_write_back_the_tensors_transformers_saved(hf_checkpoint):
    path = hf_checkpoint("phi3")
    saved = load_file(str(path / "model.safetensors"))
    loaded = load_model(str(path))
    written = dict(family_of(loaded.config).hf_names.checkpoint_tensors(loaded.params))
    assert "model.layers.1.self_attn.qkv_proj.weight" in written
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)


def assert_same_model(a, b) -> None:  # noqa: ANN001 (LoadedModel)
    assert a.config == b.config and sorted(a.params) == sorted(b.params)
    for name, value in a.params.items():
        np.testing.assert_array_equal(np.asarray(b.params[name]), value, err_msg=name)


def test_a_checkpoint_written_from_our_params_loads_back_equal(hf_checkpoint, tmp_path):
    """Our config.json and fused tensors (HF safetensors), and a converted (orbax) copy."""
    src = hf_checkpoint("phi3_longrope")
    loaded = load_model(str(src))
    out = tmp_path / "written"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    (out / "config.json").write_text(json.dumps(loaded.config.to_hf_dict()))
    save_file(dict(family_of(loaded.config).hf_names.checkpoint_tensors(loaded.params)),
              str(out / "model.safetensors"))
    assert_same_model(loaded, load_model(str(out)))
    assert_same_model(loaded, load_model(save_converted(loaded, tmp_path / "converted")))


def test_a_sharded_checkpoint_reads_the_same_fused_weights(hf_checkpoint):
    whole = load_model(str(hf_checkpoint("phi3")))
    assert_same_model(whole, load_model(str(hf_checkpoint("phi3", max_shard_size="40KB"))))


def test_a_fused_tensor_of_the_wrong_shape_is_a_clear_error(hf_checkpoint, tmp_path):
    path = tmp_path / "short"
    shutil.copytree(hf_checkpoint("phi3"), path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:96]  # q, k; no v
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.self_attn\.qkv_proj\."
                                         r"weight' has shape \(96, 64\), expected \(128, 64\)"):
        load_model(str(path))


def test_the_rotary_tables_are_short_and_long_with_the_scale_folded_in(hf_checkpoint):
    loaded = load_model(str(hf_checkpoint("phi3_longrope")))
    tables = Phi3(loaded.config, loaded.params, rotary_lookup=True, max_positions=64)
    plain = Phi3(loaded.config.replace(max_position_embeddings=ORIGINAL), loaded.params,
                 rotary_lookup=True, max_positions=64)
    scale = np.sqrt(1 + np.log(512 / ORIGINAL) / np.log(ORIGINAL))
    assert tables.rotary_table[...].shape == (2, 64, 2, 8)
    np.testing.assert_allclose(tables.rotary_table[...], plain.rotary_table[...] * scale,
                               rtol=1e-6)
