"""Both Pallas kernels check their common arguments with one function (tiling.check_attention_args)
and refuse the same bad calls with the same message."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.kernels import ragged_paged_attention_gpu, ragged_paged_attention_tpu

Q = jnp.zeros((8, 4, 16))
CACHE = jnp.zeros((1, 2, 4, 8, 16))
META = (jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.int32),
        jnp.zeros(3, jnp.int32))

BAD = {
    "head_dim": ((Q, jnp.zeros((1, 2, 4, 8, 32)), jnp.zeros((1, 2, 4, 8, 32))), {},
                 "do not match q head_dim 16"),
    "v shape": ((Q, CACHE, jnp.zeros((1, 2, 5, 8, 16))), {}, "do not match"),
    "window": ((Q, CACHE, CACHE), {"sliding_window": 0}, "sliding_window must be positive"),
    "soft cap": ((Q, CACHE, CACHE), {"soft_cap": -1.0}, "soft_cap must be positive"),
    "heads": ((jnp.zeros((8, 3, 16)), CACHE, CACHE), {},
              "num_q_heads=3 must be a multiple of num_kv_heads=2"),
}


@pytest.mark.parametrize("kernel", [ragged_paged_attention_tpu, ragged_paged_attention_gpu],
                         ids=["tpu", "gpu"])
@pytest.mark.parametrize("case", list(BAD))
def test_kernels_refuse_bad_arguments_alike(kernel, case):
    arrays, kwargs, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        kernel(*arrays, *META, sm_scale=0.25, interpret=True, **kwargs)
