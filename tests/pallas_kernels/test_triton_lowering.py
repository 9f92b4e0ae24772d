"""Both kernels lower through Pallas' Triton backend, checked on any machine.

Exporting for CUDA runs the whole Pallas-to-Triton-IR lowering without a GPU, so a kernel that
only the interpreter accepts (a non-power-of-two load, an unsupported primitive, mismatched dot
operand types) fails here in CI. Compiling that IR to a GPU binary needs a GPU (the `gpu` tests).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxkv import pallas_kernels as pk

TRITON_CALL = "__gpu$xla.gpu.triton"


def _triton_calls(fn, *args) -> int:
    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*args)
    return exported.mlir_module().count(f"@{TRITON_CALL}(")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_block_sparse_forward_and_backward_lower_to_triton(dtype):
    q = jnp.zeros((1, 8, 200, 128), dtype)
    k = jnp.zeros((1, 2, 200, 128), dtype)
    gate_bias = jnp.zeros((1, 2, 200))
    idx, cnt = pk.dense_causal_block_lists(1, 8, 200, block_q=64, block_k=32)

    def loss(q, k, v, gate_bias):
        out, lse = pk.block_sparse_attention(
            q,
            k,
            v,
            idx,
            cnt,
            sm_scale=0.1,
            gate_bias=gate_bias,
            band=4,
            block_q=64,
            block_k=32,
            return_lse=True,
        )
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(lse > -jnp.inf, lse, 0.0))

    # Forward (kept for the VJP), dQ and dK/dV/dgate.
    assert _triton_calls(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, gate_bias) == 3


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("pages_dtype", [jnp.bfloat16, jnp.int8])
def test_paged_decode_lowers_to_triton(pages_dtype):
    pages = jnp.zeros((40, 16, 128), pages_dtype)
    table = jnp.zeros((2, 8, 10), jnp.int32)
    lengths = jnp.zeros((2, 8), jnp.int32)
    quant = {}
    if pages_dtype == jnp.int8:
        quant = dict(
            k_scales=jnp.ones((40, 16)),
            v_scales=jnp.ones((40, 16)),
            k_channel_scales=jnp.ones((2, 8, 128)),
            v_channel_scales=jnp.ones((2, 8, 128)),
        )

    def decode(q, k_pages, v_pages):
        return pk.paged_decode_attention(
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            sm_scale=0.1,
            return_stats=True,
            return_probs=True,
            **quant,
        )

    assert _triton_calls(decode, jnp.zeros((2, 32, 128), jnp.bfloat16), pages, pages) == 1
