"""Tiny random HF checkpoints (every family) built locally with `save_pretrained`, for tests.

torch and transformers are imported inside the functions: importing them costs ~8 s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

KINDS = ("llama", "llama3.1", "mistral", "qwen2", "qwen3")
MOE_KINDS = ("qwen3_moe", "mixtral")  # 4 experts, top 2
# Windows of 24 tokens (prompts slide past them); gemma2: local and global layers alternating,
# attention and final logits soft-capped at values the tiny model's scores reach; gemma3: two
# local layers to one global, the global RoPE base and linear scaling of its own, q/k norm
GEMMA_KINDS = ("gemma2", "gemma3")
# Windows of 24 tokens; phi3_longrope: LongRoPE's long factors past 48 tokens (of 512), its
# short and long factors random in [1, 4]
PHI3_KINDS = ("phi3", "phi3_longrope")
BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1  # the trainer gives the special tokens the first ids, in order

# Text to train the byte-level BPE on; the non-ASCII line leaves multi-byte characters split
# over several byte tokens.
TRAINING_TEXT = [
    "Once upon a time there was a little robot who lived by the sea.",
    "The robot liked to read books about boats, fish and the stars at night.",
    "Every morning it said hello to the birds and the old lighthouse keeper.",
    "Café crème, naïve façade — 日本語のテキスト ☃ and emoji 🙂 too.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_MODEL_CACHE: dict[str, Any] = {}


def _hf_config(kind: str, *, tie: bool, num_kv_heads: int, vocab_size: int,
               num_heads: int = 4, num_layers: int = 2, hidden_size: int = 64,
               max_position_embeddings: int | None = None) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, tie_word_embeddings=tie,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, rms_norm_eps=1e-6,
    )
    if max_position_embeddings is not None:
        common["max_position_embeddings"] = max_position_embeddings
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if kind == "llama3.1":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling,
                                        max_position_embeddings=131072)
    if kind == "mistral":
        return transformers.MistralConfig(**common, rope_theta=1000000.0)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=32, rope_theta=1000000.0,
                                           num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=hidden_size // 2,
                                           norm_topk_prob=True)
    if kind == "mixtral":
        return transformers.MixtralConfig(**(common | {"intermediate_size": hidden_size // 2}),
                                          rope_theta=1000000.0, num_local_experts=4,
                                          num_experts_per_tok=2)
    if kind == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=hidden_size // num_heads,
                                         query_pre_attn_scalar=24, sliding_window=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if kind == "gemma3":
        types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                 for i in range(num_layers)]
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
        return transformers.Gemma3TextConfig(**common, head_dim=32, sliding_window=24,
                                             layer_types=types, rope_parameters=rope,
                                             query_pre_attn_scalar=32)
    if kind in PHI3_KINDS:
        # weights large enough that attention, and so the RoPE and the window, decide the
        # greedy tokens; HF's pad id (32000) lies past the vocabulary
        phi3 = common | {"pad_token_id": None, "sliding_window": 24, "initializer_range": 0.2}
        if kind == "phi3_longrope":
            import numpy as np

            pairs = hidden_size // num_heads // 2
            factors = np.random.default_rng(7).uniform(1.0, 4.0, (2, pairs))
            phi3 = {"max_position_embeddings": 512} | phi3 | {
                "original_max_position_embeddings": 48,
                "rope_scaling": {"rope_type": "longrope", "short_factor": factors[0].tolist(),
                                 "long_factor": factors[1].tolist()}}
        return transformers.Phi3Config(**phi3, rope_theta=10000.0)
    raise ValueError(f"kind must be one of {KINDS + MOE_KINDS + GEMMA_KINDS + PHI3_KINDS}, "
                     f"got {kind!r}")


def _perturb(model: Any) -> None:
    """HF initialises norm scales to 1 and biases to 0; randomise them so a loader that swaps
    or drops them is caught."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))


def _sharpen_attention(model: Any) -> None:
    """Scale q and k up so attention scores reach the soft cap's range: at HF's init the
    scores are ~0.01 and capping them would change nothing a test could see."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)


def build_tokenizer(out_dir: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE (`tokenizer.json`) with BOS/EOS specials, a BOS-adding post-processor
    and a chat template, saved through transformers the way real checkpoints are."""
    from transformers import PreTrainedTokenizerFast

    from jaxserve.models.tokenizer_builders import trained_byte_level_bpe

    tok = trained_byte_level_bpe(TRAINING_TEXT, vocab_size, BOS, EOS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out_dir))


def build_hf_checkpoint(tmp_dir: Path, kind: str, *, tie: bool = False,
                        num_kv_heads: int | None = None, seed: int = 0, vocab_size: int = 320,
                        dtype: str = "float32", max_shard_size: str | None = None,
                        num_heads: int = 4, num_layers: int = 2, hidden_size: int = 64,
                        max_position_embeddings: int | None = None) -> Path:
    """Write a tiny random checkpoint of `kind` (hidden 64, 2 layers, 4 heads, head_dim 16;
    qwen3: head_dim 32; `num_heads` 8 gives head_dim 8) with 2 KV heads by default (GQA; pass
    num_heads for MHA) into a new directory
    under `tmp_dir` and return it. `max_shard_size` (e.g. "40KB") writes a sharded checkpoint
    with `model.safetensors.index.json`. `num_layers`, `hidden_size` (the MLP twice as wide)
    and `max_position_embeddings` change the shape (draft models)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    config = _hf_config(kind, tie=tie, num_kv_heads=num_kv_heads or 2, vocab_size=vocab_size,
                        num_heads=num_heads, num_layers=num_layers, hidden_size=hidden_size,
                        max_position_embeddings=max_position_embeddings)
    shape = (f"-L{num_layers}-d{hidden_size}" if (num_layers, hidden_size) != (2, 64) else ""
             ) + (f"-pos{max_position_embeddings}" if max_position_embeddings else "")
    name = (f"{kind}-{'tied' if tie else 'untied'}-h{num_heads}-kv{config.num_key_value_heads}"
            f"-s{seed}{shape}"
            f"-v{vocab_size}-{dtype}" + (f"-shard{max_shard_size}" if max_shard_size else ""))
    out_dir = Path(tmp_dir) / name
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    if kind in GEMMA_KINDS:
        _sharpen_attention(model)
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), **kwargs)
    build_tokenizer(out_dir, vocab_size)
    return out_dir


def build_truncated_draft(tmp_dir: Path, target: Path, num_layers: int,
                          num_kv_heads: int) -> Path:
    """A draft model cut from `target`: its first `num_layers` layers, final norm and LM head,
    each KV head repeated up to `num_kv_heads` (the same function, a KV cache of another
    shape), saved with `save_pretrained` as a checkpoint of its own. It computes what the
    target's first layers do (layer skip's drafts), so it agrees with the target often."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    state = {}
    for name, w in model.state_dict().items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        if ".k_proj." in name or ".v_proj." in name:  # [Hkv * D, ...]: rows by head
            heads = w.reshape(kv_heads, -1).repeat_interleave(num_kv_heads // kv_heads, 0)
            w = heads.reshape(num_kv_heads * head_dim, *w.shape[1:])
        state[name] = w
    draft_cfg = cfg.__class__(**(cfg.to_dict() | {"num_hidden_layers": num_layers,
                                                   "num_key_value_heads": num_kv_heads}))
    draft = transformers.AutoModelForCausalLM.from_config(draft_cfg, dtype=torch.float32)
    draft.load_state_dict(state, strict=True)
    out_dir = Path(tmp_dir) / f"{target.name}-first{num_layers}-kv{num_kv_heads}"
    draft.save_pretrained(str(out_dir))
    return out_dir


def copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of checkpoint `src` at `dst` with config.json entries replaced."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_model(path: str | Path) -> Any:
    """The checkpoint at `path` as a float32 transformers model in eval mode (cached per path)."""
    key = str(Path(path).resolve())
    if key not in _MODEL_CACHE:
        import torch
        import transformers

        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager")
        _MODEL_CACHE[key] = model.eval()
    return _MODEL_CACHE[key]


# The `hf_checkpoint` fixture: `hf_checkpoint(kind, **build_hf_checkpoint kwargs) -> Path`.
Factory = Callable[..., Path]
