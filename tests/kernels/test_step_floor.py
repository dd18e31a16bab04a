"""The step's floor, counted by hand for a two-layer model: a decode at 10 tokens of context
beside a 4-token prefill from position 0."""

import dataclasses

import pytest

from jaxserve.compilation.step_floor import step_floor
from jaxserve.kernels.traffic import RaggedBatch
from jaxserve.models.gemma import FULL, SLIDING, GemmaConfig
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.moe import MoeConfig
from jaxserve.placement.targets import Chip

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
EMBED = 256 * 64 * 2  # bytes, and the LM head's as many
# per layer q, k, v, o, gate, up, down and two norms, then the final norm: in elements
DENSE = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
BATCH = RaggedBatch((1, 4), (10, 4))


def chip(flops: float) -> Chip:
    return Chip(1e3, flops, 1.0, 1, 0.0, "made up")


def floor(flops: float):
    return step_floor(CFG, 1, 2 * DENSE + 2 * EMBED, 2, BATCH, 256, chip(flops))


def test_the_floor_counts_each_byte_and_flop_once():
    f = floor(1e4)
    kv_token = 2 * 2 * 2 * 16 * 2  # K and V, layers, KV heads, head_dim, bf16
    assert f.weights == 2 * DENSE + EMBED + 5 * 64 * 2  # the head whole, 5 embedding rows
    assert f.kv_read == (10 + 4) * kv_token  # each request's visible KV once
    assert f.kv_write == 5 * kv_token
    assert f.logits == 2 * 256 * 4  # a float32 row per request
    attention_macs = 10 + (1 + 2 + 3 + 4)  # per head and head_dim: causal rows
    assert f.flops == 2 * 5 * DENSE + 2 * 2 * 256 * 64 + 4 * attention_macs * 16 * 4 * 2
    assert f.seconds == pytest.approx(f.hbm_bytes / 1e3)  # memory-bound at 1e4 flop/s


def test_taking_turns_costs_only_where_one_phase_is_compute_bound_and_the_other_is_not():
    memory_bound, compute_bound = floor(1e4), floor(1e2)
    assert memory_bound.sequential_seconds == pytest.approx(memory_bound.seconds)
    assert compute_bound.sequential_seconds == pytest.approx(compute_bound.seconds)
    # at 3e3 flop/s the dense matmuls are compute-bound, attention is memory-bound
    mixed = floor(3e3)
    dense_flops = 2 * 5 * DENSE + 2 * 2 * 256 * 64
    kv_bytes = mixed.kv_read + mixed.kv_write
    assert mixed.sequential_seconds == pytest.approx(dense_flops / 3e3 + kv_bytes / 1e3)
    assert mixed.sequential_seconds > mixed.seconds


# The same model as a mixture: its MLP is 8 experts of width 32, each token routed to 2.
MOE = MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, architecture="MixtralForCausalLM")
EXPERTS = 2 * 8 * 3 * 64 * 32  # elements: layers, experts, gate/up/down
OTHER = DENSE - 2 * 3 * 64 * 128 + 2 * 64 * 8  # less the dense MLPs, plus the routers


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mixture_reads_and_runs_only_the_experts_its_tokens_are_routed_to(tp):
    """One decode token reaches 2 of the 8 experts; five tokens (10 pairs) may reach them all.
    Per device, 1/tp of the experts' bytes and work (split by width or by experts)."""
    weight_bytes = 2 * (OTHER // tp + EXPERTS // tp) + 2 * EMBED // tp

    def at(batch: RaggedBatch):
        return step_floor(MOE, tp, weight_bytes, 2, batch, 256, chip(1e4))

    one, five = at(RaggedBatch((1,), (10,))), at(BATCH)
    assert one.weights == 2 * (OTHER // tp + EXPERTS // tp * 2 // 8) + EMBED // tp + 64 * 2 // tp
    assert five.weights == 2 * (OTHER // tp + EXPERTS // tp) + EMBED // tp + 5 * 64 * 2 // tp
    # per token its share of every other weight, per pair one expert's (2 flops a weight),
    # the LM head per request, and attention (10 visible positions, 4 q heads, 2 layers)
    head, attention = 2 * 256 * 64 // tp, 2 * 2 * 10 * 16 * (4 // tp) * 2
    assert one.flops == 2 * (OTHER // tp) + 2 * 2 * (EXPERTS // tp) // 8 + head + attention


def test_a_local_layer_reads_only_its_window():
    """Gemma's local layer at a window of 3: the decode at 10 sees 3 tokens, the prefill rows
    1, 2, 3 and 3; the global layer sees them all."""
    gemma = GemmaConfig(**{f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)}
                        | {"sliding_window": 3, "layer_types": (SLIDING, FULL)})
    f = step_floor(gemma, 1, 2 * DENSE + 2 * EMBED, 2, BATCH, 256, chip(1e4))
    kv_layer_token = 2 * 2 * 16 * 2  # K and V, KV heads, head_dim, bf16
    assert f.kv_read == ((3 + 4) + (10 + 4)) * kv_layer_token
    assert f.kv_write == 5 * 2 * kv_layer_token
    attention_macs = (3 + (1 + 2 + 3 + 3)) + (10 + (1 + 2 + 3 + 4))
    assert f.flops == 2 * 5 * DENSE + 2 * 2 * 256 * 64 + 4 * attention_macs * 16 * 4
