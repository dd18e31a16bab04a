"""Mixture-of-experts families (Qwen3-MoE, Mixtral): the Llama block with its MLP replaced by a
sparse mixture of gated experts (layers/moe.py), every layer sparse.

The config adds the experts to LlamaConfig; the params replace w_gate/w_up/w_down with the
router [L, D, E] and the experts stacked on axis 1: expert_gate/expert_up [L, E, D, F],
expert_down [L, E, F, D]. Qwen3-MoE normalises its top-k weights where `norm_topk_prob` says;
Mixtral always does (a softmax over the chosen logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve.layers.axes import AXIS
from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.moe import GROUPED_MATMULS, expert_parallel_moe, moe_mlp
from jaxserve.models import llama_weights
from jaxserve.models.llama import Llama
from jaxserve.models.llama_config import LlamaConfig, hf_fields, param_shapes
from jaxserve.models.weight_names import WeightNames

QWEN3_MOE, MIXTRAL = "Qwen3MoeForCausalLM", "MixtralForCausalLM"
MOE_SWITCHES = {QWEN3_MOE: {"qk_norm": True}, MIXTRAL: {"sliding_window": True}}
_MAX_EXPERTS = 2**14


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 1
    num_experts_per_tok: int = 1  # k: the experts each token's router picks
    moe_intermediate_size: int = 1  # each expert's FFN width
    norm_topk_prob: bool = True  # the k weights renormalised to sum to 1
    # As the devices hold it (enable_expert_parallel): num_experts / TP whole experts each
    expert_parallel: bool = False
    # As the devices run it: the grouped matmul, one of layers/moe.py's GROUPED_MATMULS
    grouped_matmul: str = "ragged_dot"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, high in (("num_experts", _MAX_EXPERTS), ("moe_intermediate_size", 2**19)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= high:
                raise ValueError(f"model config: {name} must be an integer in [1, {high}], "
                                 f"got {value!r}")
        k = self.num_experts_per_tok
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok must be an integer in [1, "
                             f"num_experts={self.num_experts}], got {k!r}")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(f"model config: grouped_matmul must be one of {GROUPED_MATMULS}, "
                             f"got {self.grouped_matmul!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"model config: norm_topk_prob must be true or false, "
                             f"got {self.norm_topk_prob!r}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "MoeConfig":
        fields = hf_fields(cfg, MOE_SWITCHES)
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("model config: dense MLP layers among the sparse ones "
                             "(mlp_only_layers, decoder_sparse_step != 1) are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model config: hidden_act must be 'silu', "
                             f"got {cfg['hidden_act']!r}")
        mixtral = fields["architecture"] == MIXTRAL
        return cls(**fields,
                   num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
                   num_experts_per_tok=cfg.get("num_experts_per_tok"),
                   moe_intermediate_size=cfg.get("moe_intermediate_size",
                                                 fields["intermediate_size"]),
                   norm_topk_prob=cfg.get("norm_topk_prob", mixtral))

    def to_hf_dict(self) -> dict[str, Any]:
        return super().to_hf_dict() | {
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob}


def moe_param_shapes(cfg: MoeConfig) -> dict[str, tuple[int, ...]]:
    L, D, E, F = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    dense = {"w_gate", "w_up", "w_down"}
    return {name: shape for name, shape in param_shapes(cfg).items() if name not in dense} | {
        "router": (L, D, E),
        "expert_gate": (L, E, D, F),
        "expert_up": (L, E, D, F),
        "expert_down": (L, E, F, D),
    }


def _hf_names(moe: str, gate: str, up: str, down: str) -> WeightNames:
    """Llama's HF names with the layer's `moe` module in place of its MLP."""
    experts = f"model.layers.{{layer}}.{moe}.experts.{{expert}}"
    tensors = {k: v for k, v in llama_weights.HF_NAMES.tensors.items()
               if k not in ("w_gate", "w_up", "w_down")}
    return WeightNames(
        tensors=tensors | {"router": f"model.layers.{{layer}}.{moe}.gate.weight",
                           "expert_gate": f"{experts}.{gate}.weight",
                           "expert_up": f"{experts}.{up}.weight",
                           "expert_down": f"{experts}.{down}.weight"},
        transposed=llama_weights.HF_NAMES.transposed | {"router", "expert_gate", "expert_up",
                                                        "expert_down"},
        ignored_suffixes=llama_weights.HF_NAMES.ignored_suffixes)


QWEN3_MOE_HF_NAMES = _hf_names("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_HF_NAMES = _hf_names("block_sparse_moe", "w1", "w3", "w2")


class MoeLlama(Llama):
    cfg: MoeConfig
    # the grouped matmuls take the experts of every layer and pick this layer's groups
    WHOLE_STACK_PARAMS = frozenset({"expert_gate", "expert_up", "expert_down"})

    def _mlp(self, h: jax.Array, w: dict[str, jax.Array], layer: int | jax.Array,
             collective: CollectiveMatmul | None, mesh: Mesh | None) -> jax.Array:
        args = (h, w["router"], w["expert_gate"], w["expert_up"], w["expert_down"],
                self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob, layer)
        if self.cfg.expert_parallel and mesh is not None and mesh.shape[AXIS] > 1:
            return expert_parallel_moe(*args, mesh, kernel=self.cfg.grouped_matmul)
        return moe_mlp(*args, kernel=self.cfg.grouped_matmul)
