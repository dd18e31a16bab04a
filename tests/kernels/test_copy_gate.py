"""The compile check's copy gate on compiled HLO text: which ops count as copies of the KV cache
and which as relaid-out weights. The weight and activation lines are trimmed from the target
compiler's own (libtpu, v5e 2x2, Llama-3-8B at TP 4), from steps whose q/k/v projections used to
relay out wq/wk/wv every step; the KV copy and the dot are written in the same form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.compilation.compile_check import (abstract_model, count_large_copies,
                                                count_weight_copies, weight_dims)
from jaxserve.layers.axes import DATA_AXIS
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.placement.sharding import AXIS

CONFIG = '{"flag_configs":[]}'
HLO = "\n".join([
    "ENTRY %main.1 () -> bf16[] {",
    # the whole wq stack relaid out once per step, and one layer's slice of wk inside the loop
    f"  %copy.116 = bf16[32,4096,1024]{{1,2,0:T(8,128)(2,1)}} copy(%param.44), "
    f"backend_config={CONFIG}",
    f"  %copy.80 = bf16[1,4096,256]{{1,2,0:T(8,128)(2,1)S(1)}} copy(%fusion.7), "
    f"backend_config={CONFIG}",
    # a prefetch of a weight stack into on-chip memory, as laid out: not a relayout
    "  %copy-start.20 = (bf16[32,4096,256]{2,1,0:T(8,128)(2,1)S(1)}, "
    "bf16[32,4096,256]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%param.45)",
    # activations: the embedding rows and q head-major for the attention kernel
    "  %transpose.80 = bf16[512,4096]{1,0:T(8,128)(2,1)} transpose(%gather.65), "
    "dimensions={0,1}",
    "  %copy.67 = bf16[2,512,4,128]{3,2,1,0:T(4,128)(2,1)S(1)} copy(%bitcast.138)",
    # a KV layer (one device's shard of K) copied
    "  %copy.9 = bf16[1,2,5296,64,128]{4,3,2,1,0:T(8,128)(2,1)} copy(%param.3)",
    "  %dot.1 = bf16[512,1024]{1,0} convolution(%a, %b)",
    "}",
])
WEIGHTS = {(32, 4096, 1024), (1, 4096, 1024), (32, 4096, 256), (1, 4096, 256),
           (128256 // 4, 4096)}


def test_relaid_out_weights_count_and_prefetches_and_activations_do_not():
    assert count_weight_copies(HLO, WEIGHTS) == 2
    assert count_weight_copies(HLO, WEIGHTS - {(1, 4096, 256)}) == 1
    assert count_weight_copies(HLO, set()) == 0


def test_cache_copies_count_the_copies_of_a_kv_layers_size_that_are_not_weights():
    layer_kv_bytes = 2 * 5296 * 64 * 128 * 2  # less than the wq stack's 256 MiB
    assert count_large_copies(HLO, layer_kv_bytes) == 2
    assert count_large_copies(HLO, layer_kv_bytes, WEIGHTS) == 1  # the KV layer alone
    assert count_large_copies(HLO, 4096 * 256 * 2) == 5  # the prefetch and activations too


def test_weight_dims_are_what_a_device_holds_and_a_layers_slice_of_a_stack():
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=128)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), (DATA_AXIS, AXIS))
    _, state = abstract_model(cfg, mesh, jnp.bfloat16, scan_layers=True)
    dims = weight_dims(state, scan_layers=True)
    assert {(2, 1024, 512), (1, 1024, 512)} <= dims  # wq: its heads split over 2 devices
    assert {(2, 1024, 1024), (1, 1024, 1024)} <= dims  # w_gate / w_up and w_down's halves
    assert (2, 1024, 128) not in dims  # wk at 512 KiB: under the gate's 1 MiB
    assert all(len(d) == 3 for d in dims)  # stacks and their slices: no norms, no embedding
    _, unrolled = abstract_model(cfg, mesh, jnp.bfloat16, scan_layers=False)
    assert weight_dims(unrolled, scan_layers=False) == set()  # [T, D] activations share dims
