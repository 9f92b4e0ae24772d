"""Causal prefill attention on TPUs (jax's splash attention, in the TPU interpreter here) against
the models' own jnp attention: outputs, logsumexps and gradients, grouped queries, sequences
that are not a multiple of the kernel's tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import pallas_kernels as pk
from jaxkv.models import layers
from tests.pallas_kernels.test_block_sparse import TOLERANCE, assert_close, assert_lse_close


def _qkv(seed, batch, heads, kv_heads, tokens, head_dim, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    shapes = [(batch, h, tokens, head_dim) for h in (heads, kv_heads, kv_heads)]
    return [
        jax.random.normal(key, shape, jnp.float32).astype(dtype)
        for key, shape in zip(keys, shapes, strict=True)
    ]


def _reference_lse(q, k, sm_scale):
    """f32 [B, N, T]: logsumexp of each query's causal scaled scores, from numpy."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    group = q.shape[1] // k.shape[1]
    scores = np.einsum("bnth,bnsh->bnts", q, np.repeat(k, group, axis=1)) * sm_scale
    tokens = q.shape[2]
    scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize(
    "heads,kv_heads,tokens,dtype",
    [(4, 4, 128, jnp.float32), (6, 2, 200, jnp.float32), (8, 2, 256, jnp.bfloat16)],
)
def test_outputs_and_logsumexp_match_the_reference(heads, kv_heads, tokens, dtype):
    q, k, v = _qkv(0, 2, heads, kv_heads, tokens, 64, dtype)
    out, lse = pk.causal_attention_tpu(q, k, v, sm_scale=0.125, return_lse=True, interpret=True)
    want = layers.causal_attention(q, k, v, sm_scale=0.125)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    assert_close(out, want, TOLERANCE[dtype])
    assert_lse_close(lse, _reference_lse(q, k, 0.125), TOLERANCE[dtype])


def test_gradients_match_the_reference():
    """Without the logsumexp, the call differentiates through splash's backward kernels."""
    q, k, v = _qkv(1, 1, 4, 2, 160, 64, jnp.float32)
    weights = jax.random.normal(jax.random.PRNGKey(2), q.shape)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) * weights)

    def kernel(q, k, v):
        return pk.causal_attention_tpu(q, k, v, sm_scale=0.2, return_lse=False, interpret=True)

    def reference(q, k, v):
        return layers.causal_attention(q, k, v, sm_scale=0.2)

    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss, argnums=(1, 2, 3))(kernel, q, k, v)
        want = jax.grad(loss, argnums=(1, 2, 3))(reference, q, k, v)
    for got_grad, want_grad in zip(got, want, strict=True):
        assert_close(got_grad, want_grad, 1e-4)
