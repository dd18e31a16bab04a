"""The Llama family's params as HF (safetensors) and GGUF (llama.cpp) checkpoints name them."""

from __future__ import annotations

from jaxserve.models.weight_names import WeightNames

# The linear layers, stored as torch's [out, in] in both formats
_LINEAR = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})

HF_NAMES = WeightNames(
    tensors={
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
        "attn_norm": "model.layers.{layer}.input_layernorm.weight",
        "wq": "model.layers.{layer}.self_attn.q_proj.weight",
        "wk": "model.layers.{layer}.self_attn.k_proj.weight",
        "wv": "model.layers.{layer}.self_attn.v_proj.weight",
        "wo": "model.layers.{layer}.self_attn.o_proj.weight",
        "bq": "model.layers.{layer}.self_attn.q_proj.bias",
        "bk": "model.layers.{layer}.self_attn.k_proj.bias",
        "bv": "model.layers.{layer}.self_attn.v_proj.bias",
        "q_norm": "model.layers.{layer}.self_attn.q_norm.weight",
        "k_norm": "model.layers.{layer}.self_attn.k_norm.weight",
        "mlp_norm": "model.layers.{layer}.post_attention_layernorm.weight",
        "w_gate": "model.layers.{layer}.mlp.gate_proj.weight",
        "w_up": "model.layers.{layer}.mlp.up_proj.weight",
        "w_down": "model.layers.{layer}.mlp.down_proj.weight",
    },
    transposed=_LINEAR,
    ignored_suffixes=("rotary_emb.inv_freq",),
)

GGUF_NAMES = WeightNames(
    tensors={
        "embed": "token_embd.weight",
        "final_norm": "output_norm.weight",
        "lm_head": "output.weight",
        "attn_norm": "blk.{layer}.attn_norm.weight",
        "wq": "blk.{layer}.attn_q.weight",
        "wk": "blk.{layer}.attn_k.weight",
        "wv": "blk.{layer}.attn_v.weight",
        "wo": "blk.{layer}.attn_output.weight",
        "bq": "blk.{layer}.attn_q.bias",
        "bk": "blk.{layer}.attn_k.bias",
        "bv": "blk.{layer}.attn_v.bias",
        "q_norm": "blk.{layer}.attn_q_norm.weight",
        "k_norm": "blk.{layer}.attn_k_norm.weight",
        "mlp_norm": "blk.{layer}.ffn_norm.weight",
        "w_gate": "blk.{layer}.ffn_gate.weight",
        "w_up": "blk.{layer}.ffn_up.weight",
        "w_down": "blk.{layer}.ffn_down.weight",
    },
    transposed=_LINEAR,
)
