"""Train jaxserve's default model: a small Llama on the Python 3.11 standard library's docstrings.

The corpus is built offline from the running interpreter's stdlib sources (PSF licence): every
module, class and function docstring, written the way it appears in source (`def name(args):`
and the indented docstring), one document each, in sorted file order. Files whose path hashes
to 0 mod 25 are held out. A byte-level BPE is trained on the training documents, then the model
(plain jnp over jaxserve's canonical weight dict, AdamW from optax) on packed windows of them.
The result is an HF `LlamaForCausalLM` directory with a model card.

    python scripts/train_tiny_model.py --out jaxserve/assets/default_model --seed 0
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import apply_rotary, inverse_frequencies, rotary_angles
from jaxserve.models.llama import LAYER_PARAMS
from jaxserve.models.llama_config import LlamaConfig, param_shapes
from jaxserve.models.tokenizer_builders import trained_byte_level_bpe

BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1
# The model never saw a chat; this plain one makes `LLM().chat(...)` work on it.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
HELDOUT_MODULUS = 25
SLICE_WINDOWS = 2  # the shipped held-out slice: the first windows of the held-out stream
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
SLICE_FILE = "heldout_slice.json"
SAMPLE_PROMPTS = ["def ", "class ", '"""Return the']


# ---------------------------------------------------------------- corpus


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {node.name}({', '.join(bases)}):" if bases else f"class {node.name}:"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def _format_doc(header: str | None, doc: str) -> str:
    if header is None:
        return f'"""{doc}"""'
    body = "\n".join(f"    {line}" if line else "" for line in doc.split("\n"))
    return f'{header}\n    """{body[4:]}"""'


def file_documents(path: Path) -> list[str]:
    """The docstrings of one source file, each as a small snippet of Python, in `ast.walk`
    (breadth-first) order."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or '"""' in doc or doc.endswith("\\"):
            continue
        header = None if isinstance(node, ast.Module) else _signature(node)
        docs.append(_format_doc(header, doc.strip()))
    return docs


def stdlib_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not SKIPPED_DIRS & set(p.relative_to(root).parts))


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % HELDOUT_MODULUS == 0


@functools.lru_cache(maxsize=2)
def collect_documents(root: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, held-out) documents of the stdlib at `root`, deduplicated, in sorted file order."""
    seen: set[str] = set()
    train, heldout = [], []
    for path in stdlib_files(Path(root)):
        relpath = path.relative_to(root).as_posix()
        for doc in file_documents(path):
            if doc in seen:
                continue
            seen.add(doc)
            (heldout if is_heldout(relpath) else train).append(doc)
    return tuple(train), tuple(heldout)


def token_stream(tok: Any, docs: list[str] | tuple[str, ...]) -> np.ndarray:
    """`<s> doc </s>` for every document, concatenated: i32[N]."""
    ids = [enc.ids + [EOS_ID] for enc in tok.encode_batch(list(docs))]
    return np.concatenate([np.asarray(x, np.int32) for x in ids])


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len inputs plus the next token: i32[W, seq_len + 1]."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


# ---------------------------------------------------------------- model


def init_params(cfg: LlamaConfig, seed: int) -> dict[str, jax.Array]:
    """normal(0.02) matrices, residual outputs scaled by 1/sqrt(2 L), norm scales 1."""
    shapes = param_shapes(cfg)
    keys = dict(zip(sorted(shapes), jax.random.split(jax.random.PRNGKey(seed), len(shapes))))
    params = {}
    for name, shape in shapes.items():
        if name.endswith("norm"):
            params[name] = jnp.ones(shape, jnp.float32)
            continue
        std = 0.02 / math.sqrt(2 * cfg.num_layers) if name in ("wo", "w_down") else 0.02
        params[name] = std * jax.random.normal(keys[name], shape, jnp.float32)
    return params


def forward(params: dict[str, jax.Array], ids: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Causal full-sequence forward: i32[B, T] -> f32[B, T, V] logits."""
    B, T = ids.shape
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    positions = jnp.arange(T, dtype=jnp.int32)
    inv_freq = jnp.asarray(inverse_frequencies(Dh, cfg.rope_theta))
    angles = rotary_angles(jnp.tile(positions, B), inv_freq)
    causal = jnp.tril(jnp.ones((T, T), bool))
    x = params["embed"][ids]  # [B, T, D]

    def layer(x: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        q = apply_rotary((h @ w["wq"]).reshape(B * T, H, Dh), angles)
        k = apply_rotary((h @ w["wk"]).reshape(B * T, K, Dh), angles)
        q = q.reshape(B, T, K, H // K, Dh)
        k = k.reshape(B, T, K, Dh)
        v = (h @ w["wv"]).reshape(B, T, K, Dh)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * Dh ** -0.5
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B, T, H * Dh)
        x = x + o @ w["wo"]
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"], None

    stacked = {n: params[n] for n in LAYER_PARAMS if n in params}
    x, _ = jax.lax.scan(layer, x, stacked)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return x @ head.T


def mean_nll(params: dict[str, jax.Array], batch: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Mean next-token NLL over i32[B, T + 1] windows."""
    logits = forward(params, batch[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


def evaluate(eval_fn: Any, params: dict[str, jax.Array], wins: np.ndarray,
             batch_size: int) -> float:
    """Mean NLL over every window (each window weighs the same: all have seq_len targets)."""
    total = 0.0
    for start in range(0, len(wins), batch_size):
        chunk = wins[start:start + batch_size]
        total += float(eval_fn(params, jnp.asarray(chunk))) * len(chunk)
    return total / len(wins)


# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainResult:
    params: dict[str, np.ndarray]
    train_loss: float
    heldout_loss: float
    slice_loss: float
    heldout_tokens: int
    train_tokens: int
    seconds: float
    curve: tuple[tuple[int, float, float], ...]  # (step, train loss, held-out loss)


def batches(train_stream_docs: list[np.ndarray], seq_len: int, batch_size: int,
            rng: np.random.Generator):
    """Endless batches i32[batch_size, seq_len + 1]: each epoch reshuffles the documents, packs
    them into windows and reshuffles the windows."""
    while True:
        order = rng.permutation(len(train_stream_docs))
        wins = windows(np.concatenate([train_stream_docs[i] for i in order]), seq_len)
        wins = wins[rng.permutation(len(wins))]
        for start in range(0, len(wins) - batch_size + 1, batch_size):
            yield wins[start:start + batch_size]


def train(cfg: LlamaConfig, tok: Any, train_docs: list[str], heldout_docs: list[str],
          args: argparse.Namespace) -> TrainResult:
    per_doc = [np.asarray(e.ids + [EOS_ID], np.int32) for e in tok.encode_batch(train_docs)]
    train_tokens = sum(len(d) for d in per_doc)
    held = windows(token_stream(tok, heldout_docs), args.seq_len)
    if len(held) < SLICE_WINDOWS:
        raise ValueError(f"held-out set has {len(held)} windows of {args.seq_len} tokens, "
                         f"need at least {SLICE_WINDOWS}")
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps,
                                                  end_value=args.lr * 0.1)
    decay_mask = lambda p: {n: not n.endswith("norm") for n in p}  # noqa: E731
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                                  mask=decay_mask))
    params = init_params(cfg, args.seed)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mean_nll)(params, batch, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_fn = jax.jit(functools.partial(mean_nll, cfg=cfg))
    data = batches(per_doc, args.seq_len, args.batch_size, np.random.default_rng(args.seed))
    start, recent, curve = time.perf_counter(), [], []
    for i in range(1, args.steps + 1):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(next(data)))
        recent = (recent + [float(loss)])[-args.log_every:]
        if i % args.log_every == 0 or i == args.steps:
            elapsed = time.perf_counter() - start
            tps = i * args.batch_size * args.seq_len / elapsed
            print(f"step {i}/{args.steps}  train loss {np.mean(recent):.4f}  "
                  f"{elapsed:.0f} s  {tps:.0f} tok/s", flush=True)
        if i % args.eval_every == 0 or i == args.steps:
            curve.append((i, float(np.mean(recent)),
                          evaluate(eval_fn, params, held, args.batch_size)))
            print(f"step {i}  held-out loss {curve[-1][2]:.4f}", flush=True)
    seconds = time.perf_counter() - start
    heldout_loss = curve[-1][2]
    slice_loss = evaluate(eval_fn, params, held[:SLICE_WINDOWS], args.batch_size)
    return TrainResult(params={n: np.asarray(p) for n, p in params.items()},
                       train_loss=float(np.mean(recent)), heldout_loss=heldout_loss,
                       slice_loss=slice_loss, heldout_tokens=int(held[:, 1:].size),
                       train_tokens=train_tokens, seconds=seconds, curve=tuple(curve))


# ---------------------------------------------------------------- output


def samples(out: Path, prompts: list[str], max_tokens: int) -> dict[str, list[str]]:
    """What jaxserve itself generates from the saved checkpoint: plain greedy, and greedy with
    repetition penalty 1.3 (a model this small loops under plain greedy decoding)."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(out))
    texts = {}
    for name, penalty in (("greedy", 1.0), ("greedy, repetition_penalty=1.3", 1.3)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                repetition_penalty=penalty)
        outs = llm.generate(prompts, params, use_tqdm=False)
        texts[name] = [p + o.outputs[0].text for p, o in zip(prompts, outs)]
    return texts


def hf_tensors(cfg: LlamaConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from jaxserve.models.registry import family_of

    return dict(family_of(cfg).hf_names.checkpoint_tensors(params))


def save_checkpoint(out: Path, cfg: LlamaConfig, tok: Any, params: dict[str, np.ndarray]) -> None:
    import transformers
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        dtype="float32", architectures=["LlamaForCausalLM"])
    hf_cfg.save_pretrained(str(out))
    transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(
        str(out))
    save_file(hf_tensors(cfg, params), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
        model_max_length=cfg.max_position_embeddings, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out))


def slice_documents(tok: Any, heldout_docs: list[str], num_tokens: int) -> list[str]:
    """The first held-out documents that together hold at least `num_tokens` stream tokens."""
    docs, count = [], 0
    for doc in heldout_docs:
        docs.append(doc)
        count += len(tok.encode(doc).ids) + 1
        if count >= num_tokens:
            return docs
    raise ValueError(f"held-out set has only {count} tokens, need {num_tokens}")


def write_card(out: Path, cfg: LlamaConfig, res: TrainResult, args: argparse.Namespace,
               command: str, stats: dict[str, Any], texts: dict[str, list[str]]) -> None:
    n_params = sum(p.size for p in res.params.values())
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 2 ** 20
    shown = "\n\n".join(f"{name}:\n```\n{text}\n```" for name, outs in texts.items()
                          for text in outs)
    vocab = (f"{cfg.vocab_size}: byte-level BPE trained with `tokenizers` on the training "
             f"documents; `{BOS}` = {BOS_ID} (added in front), `{EOS}` = {EOS_ID} "
             "(ends a document)")
    curve = "\n".join(f"| {i} | {tr:.4f} | {ho:.4f} |" for i, tr, ho in res.curve)
    card = f"""# jaxserve default model: a tiny Llama trained on Python's docstrings

A {n_params / 1e6:.2f} M-parameter `LlamaForCausalLM` (float32) that writes Python-docstring-style
text, trained from scratch on CPU by `scripts/train_tiny_model.py`. It is jaxserve's built-in
default model: small enough to ship in the package, real enough to print readable text.

## Data
The docstrings of the Python {stats['python']} standard library (`{stats['stdlib']}`), read with
`ast` from the interpreter's own source files in sorted path order (skipping the
directories {', '.join(sorted(SKIPPED_DIRS))}). Each module, class and function docstring is one
document, written as in source: `def name(args):` or `class Name(bases):` followed by the
indented docstring (module docstrings alone); duplicates are dropped. Files whose relative path
has `crc32(path) % {HELDOUT_MODULUS} == 0` are held out.
- Training: {stats['train_docs']} documents, {res.train_tokens} tokens
- Held-out: {stats['heldout_docs']} documents, {res.heldout_tokens} tokens scored

The text is part of CPython: Copyright (c) 2001-2023 Python Software Foundation, distributed
under the PSF License Version 2 (https://docs.python.org/3/license.html). The weights and the
tokenizer were made by jaxserve's script from that text and ship with jaxserve (Apache-2.0).

## Model
| | |
|---|---|
| parameters | {n_params} ({'tied' if cfg.tie_word_embeddings else 'untied'} embeddings) |
| layers / hidden / MLP | {cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size} |
| heads / KV heads / head dim | {cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim} |
| vocabulary | {vocab} |
| context | {cfg.max_position_embeddings} tokens (RoPE theta {cfg.rope_theta:g}) |
| files | {size_mb:.2f} MiB in all |

## Training
```
{command}
```
{args.steps} steps of AdamW (b1 0.9, b2 0.95, weight decay {args.weight_decay}, clip 1.0),
batch {args.batch_size} x {args.seq_len} tokens (documents packed, reshuffled each epoch),
learning rate {args.lr} with {args.warmup} warm-up steps and cosine decay to {args.lr * 0.1:g};
seed {args.seed}. {res.seconds / 60:.1f} minutes (including held-out evaluations) on
{stats['machine']}; JAX {jax.__version__}.

| step | train loss (last {args.log_every} steps) | held-out loss |
|---|---|---|
{curve}

## Results
Next-token loss in nats over non-overlapping windows of {args.seq_len} tokens:
- Final training loss (mean of the last {args.log_every} steps): {res.train_loss:.4f}
- Held-out loss: {res.heldout_loss:.4f}, held-out perplexity: {math.exp(res.heldout_loss):.3f}
- Held-out slice perplexity: {math.exp(res.slice_loss):.4f} (loss {res.slice_loss:.5f}, the
  first {SLICE_WINDOWS * args.seq_len} scored tokens of the held-out stream; the documents are
  in `{SLICE_FILE}` and `tests/test_default_model.py` recomputes it through jaxserve)

## Generating
```python
from jaxserve import LLM, SamplingParams
from jaxserve.default_model import default_model_path

llm = LLM(default_model_path())
params = SamplingParams(temperature=0.0, max_tokens={args.sample_tokens}, repetition_penalty=1.3)
print(llm.generate("def ", params)[0].outputs[0].text)
```
or `jaxserve generate "def " --repetition-penalty 1.3 --max-tokens {args.sample_tokens}` (add
`--model` with this directory where it is not the default). What jaxserve generated from
these weights when they were written:

{shown}
"""
    (out / "README.md").write_text(card)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    p.add_argument("--max-docs", type=int, default=0, help="use only the first N training "
                   "documents (and N // 10 held-out ones); 0 = all")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--sample-tokens", type=int, default=96)
    args = p.parse_args(argv)
    for name in ("vocab_size", "dim", "layers", "heads", "kv_heads", "ffn", "seq_len",
                 "batch_size", "steps", "log_every", "eval_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                             f"got {getattr(args, name)}")
    if args.dim % args.heads:
        raise ValueError(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.warmup >= args.steps:
        args.warmup = max(args.steps // 10, 1)
    return args


def main(argv: list[str] | None = None) -> TrainResult:
    args = parse_args(argv)
    train_docs, heldout_docs = map(list, collect_documents(str(args.stdlib)))
    if args.max_docs:
        train_docs, heldout_docs = train_docs[:args.max_docs], heldout_docs[:args.max_docs // 10]
    print(f"{len(train_docs)} training and {len(heldout_docs)} held-out documents", flush=True)
    tok = trained_byte_level_bpe(train_docs, args.vocab_size, BOS, EOS)
    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim,
                      intermediate_size=args.ffn, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.dim // args.heads,
                      rms_norm_eps=1e-5, max_position_embeddings=args.seq_len,
                      tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))
    res = train(cfg, tok, train_docs, heldout_docs, args)
    print(f"train loss {res.train_loss:.4f}  held-out loss {res.heldout_loss:.4f} "
          f"(ppl {math.exp(res.heldout_loss):.3f})  slice loss {res.slice_loss:.5f} "
          f"(ppl {math.exp(res.slice_loss):.4f})  {res.seconds:.0f} s", flush=True)
    out: Path = args.out
    save_checkpoint(out, cfg, tok, res.params)
    docs = slice_documents(tok, heldout_docs, SLICE_WINDOWS * args.seq_len + 1)
    (out / SLICE_FILE).write_text(json.dumps(
        {"documents": docs, "seq_len": args.seq_len, "windows": SLICE_WINDOWS}, indent=1) + "\n")
    texts = samples(out, SAMPLE_PROMPTS, args.sample_tokens) if args.sample_tokens else {}
    stats = {"python": platform.python_version(), "stdlib": "lib/python3.11",
             "train_docs": len(train_docs), "heldout_docs": len(heldout_docs),
             "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}, JAX "
                        f"{jax.devices()[0].platform} backend)"}
    command = " ".join(["python scripts/train_tiny_model.py",
                        *(argv if argv is not None else sys.argv[1:])])
    write_card(out, cfg, res, args, command, stats, texts)
    print(f"wrote {out}", flush=True)
    return res


if __name__ == "__main__":
    main()
