"""The shipped default model: its card's numbers, HF parity, readable output, reproducible training.

The held-out perplexity is recomputed through jaxserve's own `Llama` forward over a paged cache
and must match the card to within 0.1% (the card prints 4 decimals; fp32 differences between
the training forward and the paged forward are ~1e-6 relative).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.default_model import DEFAULT_MODEL_DIR, default_model_path
from jaxserve.layers.attention import AttentionMetadata, get_attention_backend
from jaxserve.models.llama import Llama, init_kv_cache
from jaxserve.models.loader import load_model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_tiny_model.py"
BLOCK = 16
PPL_RTOL = 1e-3
MAX_BYTES = 8 * 2 ** 20
# One step shape: every step of these short prompts fits 32 tokens and 4 requests.
ENGINE = dict(max_model_len=256, num_kv_blocks=96, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=[32], request_buckets=[4])
PROMPTS = ["def ", '"""Return the', "def read(self, size=-1):\n    \"\"\""]
WORD = re.compile(r"[A-Za-z]{3,}")


def card() -> str:
    return (DEFAULT_MODEL_DIR / "README.md").read_text()


def card_number(pattern: str) -> float:
    match = re.search(pattern, card())
    assert match, f"model card has no line matching {pattern!r}"
    return float(match.group(1))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _logits(graphdef, backend, state, ids, md, k_cache, v_cache):
    model = nnx.merge(graphdef, state)
    hidden, _, _ = model(ids, md, k_cache, v_cache, backend)
    return model.compute_logits(hidden)


def jaxserve_logits(loaded, token_ids: list[int]) -> np.ndarray:
    """f32[T, V]: one prefill of `token_ids` through the paged-cache forward (xla backend)."""
    n = len(token_ids)
    num_blocks = -(-n // BLOCK)
    k_cache, v_cache = init_kv_cache(loaded.config, num_blocks + 1, BLOCK)
    table = np.arange(1, num_blocks + 1, dtype=np.int32)[None]
    pos = np.arange(n, dtype=np.int32)
    md = AttentionMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(table[0][pos // BLOCK] * BLOCK
                                                             + pos % BLOCK),
        query_start_loc=jnp.asarray([0, n], jnp.int32), seq_lens=jnp.asarray([n], jnp.int32),
        block_tables=jnp.asarray(table))
    graphdef, state = nnx.split(Llama(loaded.config, loaded.params))
    return np.asarray(_logits(graphdef, get_attention_backend("xla"), state,
                              jnp.asarray(token_ids, jnp.int32), md, k_cache, v_cache))


@pytest.fixture(scope="module")
def loaded():
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def llm(xla_cache: str) -> LLM:
    return LLM(default_model_path(), compilation_cache_dir=xla_cache, **ENGINE)


def test_heldout_slice_perplexity_matches_the_card(loaded):
    piece = json.loads((DEFAULT_MODEL_DIR / "heldout_slice.json").read_text())
    seq_len, num_windows = piece["seq_len"], piece["windows"]
    tok = loaded.tokenizer
    stream = [t for doc in piece["documents"] for t in tok.encode(doc) + [tok.eos_token_id]]
    assert stream[0] == tok.bos_token_id and len(stream) > num_windows * seq_len
    nll = []
    for w in range(num_windows):
        window = stream[w * seq_len:(w + 1) * seq_len + 1]
        shifted = jaxserve_logits(loaded, window[:-1]).astype(np.float64)
        shifted -= shifted.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll.extend(-logp[np.arange(seq_len), window[1:]])
    assert len(nll) == num_windows * seq_len
    expected = card_number(r"Held-out slice perplexity: ([0-9.]+)")
    assert math.exp(np.mean(nll)) == pytest.approx(expected, rel=PPL_RTOL)
    # a trained model, not noise: far below the vocabulary size a uniform guess would score
    assert expected < loaded.config.vocab_size / 20


def test_card_matches_the_shipped_files(loaded):
    text = card()
    n_params = sum(p.size for p in loaded.params.values())
    assert card_number(r"\| parameters \| (\d+)") == n_params
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir() if f.is_file())
    assert size <= MAX_BYTES
    assert "PSF License Version 2" in text
    assert "python scripts/train_tiny_model.py" in text
    held_ppl = card_number(r"held-out perplexity: ([0-9.]+)")
    assert math.exp(card_number(r"Held-out loss: ([0-9.]+)")) == pytest.approx(held_ppl, rel=1e-3)
    assert loaded.config.vocab_size == loaded.tokenizer.vocab_size


def test_default_model_path_names_the_directory_when_files_are_missing(monkeypatch, tmp_path):
    from jaxserve import default_model

    assert Path(default_model_path()) == DEFAULT_MODEL_DIR
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        default_model.default_model_path()


def test_hf_transformers_greedy_matches_jaxserve(llm):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    path = default_model_path()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False, eos_token_id=None, pad_token_id=1)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


@functools.cache
def stdlib_words() -> frozenset[str]:
    """Every word of the Python standard library's source, which holds the training text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    words: set[str] = set()
    for path in root.glob("**/*.py"):
        if "site-packages" not in path.parts:
            words.update(WORD.findall(path.read_text(errors="replace")))
    return frozenset(words)


def known_fraction(text: str) -> tuple[float, int]:
    words = WORD.findall(text)
    return sum(w in stdlib_words() for w in words) / max(len(words), 1), len(words)


def test_the_default_model_chats_through_its_template_as_transformers_renders_it(llm):
    import transformers

    messages = [{"role": "user", "content": "Read a file."}]
    want = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(want)
    assert out.outputs[0].token_ids and out.outputs[0].finish_reason in ("stop", "length")


def test_generate_cli_prints_docstring_style_text(llm, xla_cache, capsys):
    from jaxserve.entrypoints.cli.main import main

    engine_flags = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in ENGINE.items()]
    rc = main(["generate", "def ", "--model", default_model_path(), "--max-tokens", "64",
               f"--compilation-cache-dir={xla_cache}", *engine_flags])
    assert rc == 0
    text = capsys.readouterr().out.split("\n" + "-" * 40)[0]
    assert text.startswith("def ") and '"""' in text and "\ufffd" not in text
    fraction, count = known_fraction(text)
    assert count >= 10 and fraction >= 0.8, text


def test_sampled_text_is_mostly_stdlib_words_unlike_random_tokens(llm):
    prompts = ["def ", "class ", '"""Return the']
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=96, seed=0),
                        use_tqdm=False)
    text = "\n".join(p + o.outputs[0].text for p, o in zip(prompts, outs))
    assert "\ufffd" not in text
    fraction, count = known_fraction(text)
    assert count >= 50 and fraction >= 0.75, text
    # the check tells text from noise: random tokens of the same vocabulary fail it
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(0)
    noise = "\n".join(tok.decode(rng.integers(2, tok.vocab_size, 96).tolist()) for _ in prompts)
    assert known_fraction(noise)[0] < 0.5


def _load_script(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("train_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_training_twice_with_one_seed_gives_identical_losses(tmp_path, monkeypatch):
    script = _load_script(monkeypatch)
    tiny = ["--max-docs", "300", "--vocab-size", "300", "--dim", "32", "--layers", "2",
            "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--seq-len", "64",
            "--batch-size", "4", "--steps", "20", "--seed", "3", "--sample-tokens", "0"]
    first = script.main(["--out", str(tmp_path / "a"), *tiny])
    second = script.main(["--out", str(tmp_path / "b"), *tiny])
    assert first.heldout_loss == second.heldout_loss
    assert first.train_loss == second.train_loss
    for name, value in first.params.items():
        np.testing.assert_array_equal(value, second.params[name], err_msg=name)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json").read_text()
    other = script.main(["--out", str(tmp_path / "c"), *tiny[:-4], "--seed", "4",
                         "--sample-tokens", "0"])
    assert other.heldout_loss != first.heldout_loss
