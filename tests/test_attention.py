"""The "xla" attention backend against brute-force numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import attention


def _numpy_attention(q, k, v, mask, scale):
    """Per (query head, query) softmax over the visible keys; q [N, T, H], k/v [K, S, H]."""
    n, t, _ = q.shape
    group = n // k.shape[0]
    out = np.zeros_like(q, dtype=np.float64)
    for head in range(n):
        kv_head = head // group
        for i in range(t):
            visible = np.flatnonzero(mask[head, i])
            if len(visible) == 0:
                continue
            s = (k[kv_head, visible] @ q[head, i]) * scale
            p = np.exp(s - s.max())
            out[head, i] = (p / p.sum()) @ v[kv_head, visible]
    return out


def _qkv(rng, b, n, kh, t, s, h):
    return (
        rng.standard_normal((b, n, t, h)).astype(np.float32),
        rng.standard_normal((b, kh, s, h)).astype(np.float32),
        rng.standard_normal((b, kh, s, h)).astype(np.float32),
    )


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    t=st.integers(1, 40),
    block=st.sampled_from([4, 8, 16]),
    per_kv_head=st.booleans(),
)
def test_block_sparse_reference_matches_token_mask(seed, t, block, per_kv_head):
    rng = np.random.default_rng(seed)
    b, n, kh, h = 2, 4, 2, 8
    q, k, v = _qkv(rng, b, n, kh, t, t, h)
    nq = -(-t // block)
    heads = kh if per_kv_head else n
    listed = rng.random((b, heads, nq, nq)) < 0.6
    idx = np.zeros((b, heads, nq, nq), np.int32)
    cnt = listed.sum(-1).astype(np.int32)
    for index in np.ndindex(b, heads, nq):
        chosen = np.flatnonzero(listed[index])
        idx[index][: len(chosen)] = chosen
    out = attention.block_sparse_attention(
        q, k, v, idx, cnt, sm_scale=0.3, block_q=block, block_k=block
    )
    for batch in range(b):
        token_mask = np.zeros((n, t, t), bool)
        for head in range(n):
            for i in range(t):
                for j in range(i + 1):
                    list_head = head // (n // kh) if per_kv_head else head
                    token_mask[head, i, j] = listed[batch, list_head, i // block, j // block]
        expected = _numpy_attention(q[batch], k[batch], v[batch], token_mask, 0.3)
        np.testing.assert_allclose(np.asarray(out[batch]), expected, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_paged_attention_equals_dense_over_held_tokens(page_size):
    rng = np.random.default_rng(page_size)
    b, n, kh, h, max_pages, c = 3, 8, 2, 16, 5, 3
    num_pages = b * kh * max_pages + 4
    k_pages = rng.standard_normal((num_pages, page_size, h)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, h)).astype(np.float32)
    table = rng.permutation(num_pages)[: b * kh * max_pages].reshape(b, kh, max_pages)
    cap = max_pages * page_size
    lengths = rng.choice([0, 1, page_size - 1 or 1, page_size, page_size + 1, cap], (b, kh))
    table = np.where(np.arange(max_pages) < -(-lengths[..., None] // page_size), table, -1)
    q = rng.standard_normal((b, n, c, h)).astype(np.float32)
    out, lse = attention.paged_attention(
        q, k_pages, v_pages, table.astype(np.int32), lengths.astype(np.int32), sm_scale=0.25
    )
    assert np.all(np.isfinite(np.asarray(out)))
    for batch in range(b):
        k = np.zeros((kh, cap, h), np.float32)
        v = np.zeros((kh, cap, h), np.float32)
        mask = np.zeros((n, c, cap), bool)
        for head in range(kh):
            held = lengths[batch, head]
            pages = table[batch, head][: -(-held // page_size)]
            k[head, :held] = k_pages[pages].reshape(-1, h)[:held]
            v[head, :held] = v_pages[pages].reshape(-1, h)[:held]
            mask[head * 4 : head * 4 + 4, :, :held] = True
        expected = _numpy_attention(q[batch], k, v, mask, 0.25)
        np.testing.assert_allclose(np.asarray(out[batch]), expected, atol=1e-5)
        empty = np.repeat(lengths[batch] == 0, n // kh)
        assert np.all(np.isneginf(np.asarray(lse[batch])[empty]))
        assert np.all(np.asarray(out[batch])[empty] == 0)


def test_merged_partials_equal_attention_over_the_union():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 4, 2, 5, 30, 8)
    full_mask = rng.random((2, 2, 1, 5, 30)) < 0.7
    split = rng.random(30) < 0.5
    full, full_lse = attention.masked_attention(q, k, v, full_mask, 0.5)
    a, lse_a = attention.masked_attention(q, k, v, full_mask & split, 0.5)
    b, lse_b = attention.masked_attention(q, k, v, full_mask & ~split, 0.5)
    merged, merged_lse = attention.merge_partials(a, lse_a, b, lse_b)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(full), atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged_lse), np.asarray(full_lse), atol=1e-5)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 2, 1, 3, 4, 8)
    mask = np.array([[True] * 4, [False] * 4, [True, False, False, False]])[None, None, None]

    def loss(q, k, v):
        out, _ = attention.masked_attention(q, k, v, mask, 1.0)
        return jnp.sum(out**2), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert np.all(np.asarray(out)[:, :, 1] == 0)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_chunk_attention_masks_padding_and_future():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 2, 2, 4, 4, 8)
    positions = np.array([[7, 8, 9, -1]], np.int32)
    out, _ = attention.chunk_attention(q, k, v, positions, sm_scale=1.0)
    mask = np.tril(np.ones((4, 4), bool))
    mask[:, 3] = False
    expected = _numpy_attention(q[0], k[0], v[0], np.broadcast_to(mask, (2, 4, 4)), 1.0)
    np.testing.assert_allclose(np.asarray(out[0, :, :3]), expected[:, :3], atol=1e-6)


def test_backend_names_are_validated():
    allowed = "'xla', 'pallas', 'interpret', 'interpret-tpu', 'auto'"
    with pytest.raises(ValueError, match=f"backend='cuda'.*{allowed}"):
        attention.resolve_backend("cuda")
    assert attention.resolve_backend("interpret") is attention.Backend.INTERPRET
    assert attention.resolve_backend("interpret-tpu") is attention.Backend.INTERPRET_TPU
    # "pallas" is checked where the platform is known (tests/test_lowering.py); "auto" by the
    # default backend, never to the Pallas path on a CPU or a TPU.
    assert attention.resolve_backend("pallas") is attention.Backend.PALLAS
    on_gpu = jax.default_backend() == "gpu"
    auto = attention.Backend.PALLAS if on_gpu else attention.Backend.XLA
    assert attention.resolve_backend("auto") is attention.resolve_backend(attention.Backend.AUTO)
    assert attention.resolve_backend("auto") is auto


def test_pallas_without_a_gpu_is_an_error_naming_the_alternatives():
    """Run eagerly or compiled on a CPU device, and before any tracing at a call site that runs
    programs here (`check_runs_here`)."""
    cpu = jax.devices("cpu")[0]
    q = jax.device_put(jnp.zeros((1, 2, 16, 16)), cpu)
    k = jax.device_put(jnp.zeros((1, 1, 16, 16)), cpu)
    error = r"backend='pallas'.*NVIDIA GPU.*platform 'cpu'.*'interpret'.*'xla'"
    with pytest.raises(ValueError, match=error):
        attention.causal_attention(q, k, k, sm_scale=1.0, backend="pallas")
    with jax.default_device(cpu), pytest.raises(ValueError, match=error):
        jax.jit(attention.causal_attention, static_argnames=("sm_scale", "backend"))(
            q, k, k, sm_scale=1.0, backend="pallas"
        )
    assert attention.check_runs_here("xla") is attention.Backend.XLA
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=error):
            attention.check_runs_here("pallas")
