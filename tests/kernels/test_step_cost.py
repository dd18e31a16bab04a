"""The step's cost model reads compiled HLO as a chip runs it: loop bodies times their trip
counts, what fusions slice out of their operands, device memory only (not VMEM), collectives
hidden by the ops scheduled between their start and done. Checked against XLA's own cost
analysis of the same programs with each loop body multiplied by its trip count (an independent
reading: XLA's HloCostAnalysis, run on each loop body as a module of its own)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.compilation import hlo_text
from jaxserve.compilation.step_cost import step_cost, trip_count
from jaxserve.kernels.traffic import RaggedBatch
from jaxserve.placement.targets import Chip
from xla_reading import xla_bytes, xla_reading

CHIP = Chip(hbm_bandwidth=1e12, bf16_flops=1e15, link_bandwidth=5e10, ports=2,
            collective_latency=1e-6, source="test")
ALL_SPACES = frozenset(range(8))
ONE = RaggedBatch((1,), (1,))


def compiled_scan(num_layers: int) -> str:
    """A small layer stack over stacked weights, scanned as the engine's TPU/GPU step is."""
    def step(w1, w2, x):
        def layer(x, i):
            return x + jax.nn.silu(x @ w1[i]) @ w2[i], None
        return jax.lax.scan(layer, x, jnp.arange(num_layers))[0]

    args = (jax.ShapeDtypeStruct((num_layers, 256, 512), jnp.float32),
            jax.ShapeDtypeStruct((num_layers, 512, 256), jnp.float32),
            jax.ShapeDtypeStruct((64, 256), jnp.float32))
    return jax.jit(step).lower(*args).compile().as_text()


@pytest.mark.parametrize("num_layers", [3, 8])
def test_model_counts_each_layer_as_xla_does_with_loops_times_their_trip_count(num_layers):
    text = compiled_scan(num_layers)
    module = hlo_text.parse(text)
    loops = [i for i in module.entry_computation.instructions if i.opcode == "while"]
    assert len(loops) == 1 and trip_count(module, loops[0], module.entry_computation) == \
        num_layers
    cost = step_cost(module, CHIP, ONE, 1, ALL_SPACES)
    reading = xla_reading(text, {loops[0].called[1]: num_layers})
    assert cost.hbm_bytes == pytest.approx(reading, rel=0.10)
    weights = 2 * num_layers * 256 * 512 * 4
    assert cost.hbm_bytes > weights  # each layer's weights are read once: all of them
    assert cost.flops == pytest.approx(num_layers * 2 * 2 * 64 * 256 * 512)


def test_the_one_layer_count_is_what_xla_reports_without_trip_counts():
    text = compiled_scan(8)
    cost = step_cost(hlo_text.parse(text), CHIP, ONE, 1, ALL_SPACES)
    assert xla_bytes(text) < cost.hbm_bytes / 4  # XLA's own figure: the body once


HLO_VMEM_AND_ASYNC = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[1024,1024], p1: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[1024,1024]{1,0:T(8,128)} parameter(0), metadata={op_name="state['w']"}
  %p1 = f32[1024,1024]{1,0:T(8,128)} parameter(1), metadata={op_name="x"}
  %ar = f32[1024,1024]{1,0:T(8,128)S(1)} all-reduce-start(%p1), replica_groups={{0,1,2,3}}, to_apply=%add
  %dot = f32[1024,1024]{1,0:T(8,128)S(1)} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %done = f32[1024,1024]{1,0:T(8,128)S(1)} all-reduce-done(%ar)
  ROOT %sum = f32[1024,1024]{1,0:T(8,128)} add(%done, %dot)
}
"""


def test_vmem_arrays_move_no_device_memory_and_weights_are_told_apart():
    cost = step_cost(hlo_text.parse(HLO_VMEM_AND_ASYNC), CHIP, ONE, 4)
    mib4 = 1024 * 1024 * 4
    assert cost.weights == 2 * mib4  # the dot reads the weight twice; its result stays in VMEM
    assert cost.activations == 2 * mib4  # the all-reduce reads x; the sum writes its result
    assert cost.flops == 2 * 1024 ** 3
    assert cost.collectives == 1 and cost.collective_bytes == pytest.approx(1.5 * mib4)


def test_an_async_collective_is_hidden_by_the_ops_between_its_start_and_done():
    module = hlo_text.parse(HLO_VMEM_AND_ASYNC)
    link = 1.5 * 4 * 2**20 / (2 * CHIP.link_bandwidth) + 6 * CHIP.collective_latency
    dot = 2 * 1024 ** 3 / CHIP.bf16_flops  # 2.1 us: compute-bound, its bytes take 8.4 us
    dot = max(dot, 2 * 4 * 2**20 / CHIP.hbm_bandwidth)
    hidden = step_cost(module, CHIP, ONE, 4)
    assert hidden.collective_seconds == pytest.approx(max(0.0, link - dot))
    sync = hlo_text.parse(HLO_VMEM_AND_ASYNC.replace("all-reduce-start", "all-reduce")
                          .replace("  %done = f32[1024,1024]{1,0:T(8,128)S(1)} "
                                   "all-reduce-done(%ar)\n", "").replace("(%done,", "(%ar,"))
    assert step_cost(sync, CHIP, ONE, 4).collective_seconds == pytest.approx(link)


def test_tiled_layouts_pad_the_minor_dims():
    module = hlo_text.parse("HloModule m\n\nENTRY %e () -> s32[100] {\n"
                            "  ROOT %c = s32[100]{0:T(1024)} constant({...})\n}\n")
    array = module.entry_computation.root.array
    assert (array.logical_bytes, array.nbytes) == (400, 4096)
