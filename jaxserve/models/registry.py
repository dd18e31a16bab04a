"""The model families jaxserve implements, and which checkpoint architectures each serves.

A family is its config, its model class and its params' names in each checkpoint format; its
layers come from `jaxserve.layers`. HF's `architectures[0]` and GGUF's `general.architecture`
pick the family; a config's `architecture` (an HF name) finds it again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from jaxserve.models import llama_weights
from jaxserve.models.gemma import GEMMA_SWITCHES, HF_NAMES as GEMMA_HF_NAMES, Gemma, GemmaConfig, \
    gemma_param_shapes
from jaxserve.models.gguf_file import GGUFFile
from jaxserve.models.llama import Llama
from jaxserve.models.llama_config import ARCHITECTURE_SWITCHES, LlamaConfig, param_shapes
from jaxserve.models.moe import (MIXTRAL_HF_NAMES, QWEN3_MOE_HF_NAMES, MoeConfig, MoeLlama,
                                 moe_param_shapes)
from jaxserve.models.phi3 import HF_NAMES as PHI3_HF_NAMES, PHI3_SWITCHES, Phi3, Phi3Config
from jaxserve.models.weight_names import WeightNames

DEFAULT_HF_ARCHITECTURE = "LlamaForCausalLM"  # a config.json without `architectures`
_Entry = TypeVar("_Entry")


@dataclass(frozen=True, slots=True, eq=False)  # one record per family: compared by identity
class ModelFamily:
    name: str
    config_type: type[LlamaConfig]
    config_from_hf: Callable[[dict[str, Any]], LlamaConfig]  # config.json's entries
    model: type[Llama]
    param_shapes: Callable[[Any], dict[str, tuple[int, ...]]]  # of a config_type
    norm_params: frozenset[str]  # scales of 1 in dummy weights
    hf_names: WeightNames
    # a GGUF's metadata, and the HF architecture its general.architecture stands for (None:
    # the family is not read from GGUFs)
    config_from_gguf: Callable[[GGUFFile, str], LlamaConfig] | None = None
    gguf_names: WeightNames | None = None


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    family: ModelFamily
    hf_architecture: str
    # llama.cpp permutes the q/k rows into interleaved RoPE pairs for its NORM rope ("llama")
    # and keeps HF's half-split order for NEOX-rope models (Qwen)
    interleaved_qk: bool


_NORMS = frozenset({"attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"})
LLAMA = ModelFamily(
    name="llama", config_type=LlamaConfig, config_from_hf=LlamaConfig.from_hf_dict,
    model=Llama, param_shapes=param_shapes, norm_params=_NORMS,
    hf_names=llama_weights.HF_NAMES, config_from_gguf=LlamaConfig.from_gguf,
    gguf_names=llama_weights.GGUF_NAMES)
QWEN3_MOE = ModelFamily(
    name="qwen3_moe", config_type=MoeConfig, config_from_hf=MoeConfig.from_hf_dict,
    model=MoeLlama, param_shapes=moe_param_shapes, norm_params=_NORMS,
    hf_names=QWEN3_MOE_HF_NAMES)
MIXTRAL = ModelFamily(
    name="mixtral", config_type=MoeConfig, config_from_hf=MoeConfig.from_hf_dict,
    model=MoeLlama, param_shapes=moe_param_shapes, norm_params=_NORMS,
    hf_names=MIXTRAL_HF_NAMES)
PHI3 = ModelFamily(
    name="phi3", config_type=Phi3Config, config_from_hf=Phi3Config.from_hf_dict,
    model=Phi3, param_shapes=param_shapes, norm_params=_NORMS, hf_names=PHI3_HF_NAMES)

# Gemma's norms scale by 1 + w: dummy weights keep them near 1 with small random w
GEMMA = ModelFamily(
    name="gemma", config_type=GemmaConfig, config_from_hf=GemmaConfig.from_hf_dict,
    model=Gemma, param_shapes=gemma_param_shapes, norm_params=frozenset(),
    hf_names=GEMMA_HF_NAMES)

HF_ARCHITECTURES: dict[str, ModelFamily] = {arch: LLAMA for arch in ARCHITECTURE_SWITCHES} | {
    "Qwen3MoeForCausalLM": QWEN3_MOE, "MixtralForCausalLM": MIXTRAL} | dict.fromkeys(
    GEMMA_SWITCHES, GEMMA) | dict.fromkeys(PHI3_SWITCHES, PHI3)
# Checkpoints whose text model a family serves, refused until the rest of them is supported
UNSUPPORTED_PARTS = {"Gemma3ForConditionalGeneration": "images (its vision tower) are not "
                     "supported yet; serve a Gemma3ForCausalLM (text-only) checkpoint"}
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(LLAMA, "LlamaForCausalLM", interleaved_qk=True),
    "qwen2": GGUFArchitecture(LLAMA, "Qwen2ForCausalLM", interleaved_qk=False),
    "qwen3": GGUFArchitecture(LLAMA, "Qwen3ForCausalLM", interleaved_qk=False),
}


def _lookup(table: dict[str, _Entry], name: str, field: str) -> _Entry:
    if name not in table:
        raise ValueError(f"{field}: unsupported architecture {name!r}; jaxserve supports "
                         f"{sorted(table)}")
    return table[name]


def hf_family(architecture: str, source: str = "config.json") -> ModelFamily:
    if architecture in UNSUPPORTED_PARTS:
        raise ValueError(f"{source}: architectures: {architecture}: "
                         f"{UNSUPPORTED_PARTS[architecture]}")
    return _lookup(HF_ARCHITECTURES, architecture, f"{source}: architectures")


def gguf_architecture(gguf: GGUFFile) -> GGUFArchitecture:
    return _lookup(GGUF_ARCHITECTURES, gguf.field("general.architecture"),
                   f"{gguf.path}: general.architecture")


def family_of(config: LlamaConfig) -> ModelFamily:
    return hf_family(config.architecture, "model config")


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> LlamaConfig:
    archs = cfg.get("architectures") or [DEFAULT_HF_ARCHITECTURE]
    return hf_family(archs[0], source).config_from_hf(cfg)


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig:
    arch = gguf_architecture(gguf)
    return arch.family.config_from_gguf(gguf, arch.hf_architecture)


def check_params(config: LlamaConfig, params: dict[str, Any], source: str) -> None:
    """Raise a ValueError naming the first missing, unexpected or mis-shaped tensor."""
    expected = family_of(config).param_shapes(config)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"{source}: missing weights {missing}")
    extra = sorted(set(params) - set(expected))
    if extra:
        raise ValueError(f"{source}: unexpected weights {extra}")
    for name, shape in expected.items():
        got = tuple(params[name].shape)
        if got != shape:
            raise ValueError(f"{source}: weight {name!r} has shape {got}, expected {shape}")
