"""The kernel backends of the attention dispatch ("interpret": the GPU path, "interpret-tpu": the
TPU path, on CPU) against the "xla" path and plain numpy: every op the models call, then whole
generations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention, policies
from jaxkv.models import init_model
from jaxkv.step.forward import forward
from tests.tiny_models import tiny_config

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
INTERPRETERS = ["interpret", "interpret-tpu"]


def _qkv(seed, b, n, kh, t, h, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (b, n, t, h), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, kh, t, h), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, kh, t, h), jnp.float32).astype(dtype)
    return q, k, v


def _numpy_gated(q, k, v, log_gate, band, scale):
    """Per query: causal softmax with log_gate[j] added for i - j >= band; q [N, T, H]."""
    n, t, _ = q.shape
    group = n // k.shape[0]
    out = np.zeros(q.shape)
    for head in range(n):
        kv = head // group
        for i in range(t):
            j = np.arange(i + 1)
            s = k[kv, j] @ q[head, i] * scale + np.where(i - j >= band, log_gate[kv, j], 0.0)
            p = np.exp(s - s.max())
            out[head, i] = p / p.sum() @ v[kv, j]
    return out


@pytest.mark.parametrize("backend", INTERPRETERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [40, 64, 130])  # "interpret-tpu": jnp under 128 tokens, splash from
def test_causal_attention_kernel_equals_xla(dtype, t, backend):
    q, k, v = _qkv(0, 2, 4, 2, t, 32, dtype)
    want = attention.causal_attention(q, k, v, sm_scale=0.2, backend="xla")
    got = attention.causal_attention(q, k, v, sm_scale=0.2, backend=backend)
    assert got.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("band", [0, 5, 100])
def test_gated_attention_matches_numpy_and_kernel_with_gradients(band):
    b, n, kh, t, h = 1, 4, 2, 48, 16
    q, k, v = _qkv(1, b, n, kh, t, h)
    gate = jax.random.uniform(jax.random.PRNGKey(2), (b, kh, t), minval=1e-3, maxval=1.0)
    log_gate = jnp.log(gate)
    want = _numpy_gated(*(np.asarray(x[0], np.float64) for x in (q, k, v, log_gate)), band, 0.25)
    for backend in ("xla", *INTERPRETERS):
        out = attention.gated_causal_attention(
            q, k, v, log_gate, band=band, sm_scale=0.25, backend=backend
        )
        np.testing.assert_allclose(np.asarray(out[0]), want, atol=1e-5)

    cotangent = jax.random.normal(jax.random.PRNGKey(3), q.shape)

    def loss(backend, *args):
        out = attention.gated_causal_attention(*args, band=band, sm_scale=0.25, backend=backend)
        return jnp.sum(out * cotangent)

    want_grads = jax.grad(loss, argnums=(1, 2, 3, 4))("xla", q, k, v, log_gate)
    for backend in INTERPRETERS:
        got_grads = jax.grad(loss, argnums=(1, 2, 3, 4))(backend, q, k, v, log_gate)
        for got, want_grad in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want_grad), atol=2e-5)


def test_gated_attention_bad_inputs():
    q, k, v = _qkv(0, 1, 2, 1, 8, 16)
    with pytest.raises(ValueError, match="band=-1"):
        attention.gated_causal_attention(q, k, v, jnp.zeros((1, 1, 8)), band=-1, sm_scale=1.0)
    with pytest.raises(ValueError, match="log_gate has shape"):
        attention.gated_causal_attention(q, k, v, jnp.zeros((1, 8)), band=2, sm_scale=1.0)


@pytest.mark.parametrize("backend", INTERPRETERS)
@pytest.mark.parametrize("chunk", [24, 136])
def test_chunk_attention_kernel_equals_xla_with_tail_padding(chunk, backend):
    q, k, v = _qkv(4, 2, 4, 2, chunk, 16)
    lengths = np.array([chunk, chunk // 2 + 1])
    index = np.arange(chunk)
    positions = jnp.asarray(np.where(index < lengths[:, None], 100 + index, -1), jnp.int32)
    want_out, want_lse = attention.chunk_attention(q, k, v, positions, sm_scale=0.3)
    got_out, got_lse = attention.chunk_attention(q, k, v, positions, sm_scale=0.3, backend=backend)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=1e-5)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(got_lse)[finite], np.asarray(want_lse)[finite], atol=1e-5)


def _numpy_vertical_slash(q, k, v, length, admitted, window, scale):
    """Queries i < length see keys j <= i with i - j < window or admitted[j] (the gated
    attention with log-gate 0 or -inf); padded queries give 0."""
    log_gate = np.where(admitted, 0.0, -np.inf)[:, :length]
    out = np.zeros(q.shape)
    out[:, :length] = _numpy_gated(
        q[:, :length], k[:, :length], v[:, :length], log_gate, window, scale
    )
    return out


@pytest.mark.parametrize(
    ("dtype", "window"), [(jnp.float32, 20), (jnp.float32, 70), (jnp.bfloat16, 20)]
)
def test_vertical_slash_chunk_attention_kernel_equals_xla_and_numpy(dtype, window):
    # 200 tokens: four 64-token blocks, so the band (slash) and the admitted columns of the
    # blocks wholly outside it (vertical) both hold keys; the windows end inside a block and
    # span more than one.
    q, k, v = _qkv(7, 2, 4, 2, 200, 16, dtype)
    lengths = np.array([200, 131])
    index = np.arange(200)
    positions = jnp.asarray(np.where(index < lengths[:, None], 7 + index, -1), jnp.int32)
    rng = np.random.default_rng(3)
    admitted = rng.random((2, 2, 200)) < np.array([0.02, 0.3])[:, None, None]
    results = {
        backend: attention.vertical_slash_chunk_attention(
            q, k, v, positions, jnp.asarray(admitted), window=window, sm_scale=0.3, backend=backend
        )
        for backend in ("xla", "interpret")
    }
    tolerance = TOLERANCE[dtype]
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    for b in range(2):
        want = _numpy_vertical_slash(*(x[b] for x in f32), lengths[b], admitted[b], window, 0.3)
        for backend, (out, lse) in results.items():
            np.testing.assert_allclose(np.asarray(out[b]), want, atol=tolerance, err_msg=backend)
            assert np.all(np.isinf(np.asarray(lse[b, :, lengths[b] :])))
            assert np.all(np.isfinite(np.asarray(lse[b, :, : lengths[b]])))
    np.testing.assert_allclose(
        np.asarray(results["interpret"][1]), np.asarray(results["xla"][1]), atol=tolerance
    )


def _paged_inputs(seed, *, b=2, kh=2, h=32, page=4, max_pages=5, num_pages=24, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    lengths = rng.choice([0, 1, page - 1, page, page + 1, max_pages * page], size=(b, kh))
    table = np.full((b, kh, max_pages), -1, np.int32)
    pages = rng.permutation(num_pages)
    used = 0
    for index in np.ndindex(b, kh):
        held = -(-lengths[index] // page)
        table[index][:held] = pages[used : used + held]
        used += held
    k_pages = rng.standard_normal((num_pages, page, h)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page, h)).astype(np.float32)
    return (
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(table),
        jnp.asarray(lengths, jnp.int32),
    )


@pytest.mark.parametrize("backend", INTERPRETERS)
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_kernel_equals_xla(chunk, group, backend):
    k_pages, v_pages, table, lengths = _paged_inputs(chunk * 10 + group)
    q = jax.random.normal(jax.random.PRNGKey(5), (2, 2 * group, chunk, 32))
    want = attention.paged_attention(
        q, k_pages, v_pages, table, lengths, sm_scale=0.2, return_probs=True
    )
    got = attention.paged_attention(
        q, k_pages, v_pages, table, lengths, sm_scale=0.2, return_probs=True, backend=backend
    )
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5)
    np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), atol=1e-5)
    holds_any = np.repeat(np.asarray(lengths) > 0, group, axis=1)[:, :, None]
    sums = np.asarray(want[2]).sum(-1)
    np.testing.assert_allclose(sums, np.broadcast_to(holds_any, sums.shape), atol=1e-5)


@pytest.mark.parametrize("backend", INTERPRETERS)
def test_paged_attention_page_mask_kernel_equals_xla(backend):
    k_pages, v_pages, table, lengths = _paged_inputs(7)
    q = jax.random.normal(jax.random.PRNGKey(6), (2, 4, 1, 32))
    page_mask = jax.random.bernoulli(jax.random.PRNGKey(7), 0.5, table.shape)
    want = attention.paged_attention(
        q, k_pages, v_pages, table, lengths, sm_scale=0.2, page_mask=page_mask
    )
    got = attention.paged_attention(
        q, k_pages, v_pages, table, lengths, sm_scale=0.2, page_mask=page_mask, backend=backend
    )
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5)
    np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
    with pytest.raises(ValueError, match="return_probs=True with a page_mask"):
        attention.paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            sm_scale=0.2,
            page_mask=page_mask,
            return_probs=True,
        )


def test_paged_attention_int8_kernel_equals_dequantised_reference():
    k_float, v_float, table, lengths = _paged_inputs(8)
    token_scales = jnp.max(jnp.abs(k_float), axis=-1) / 127.0
    channel_scales = jax.random.uniform(jax.random.PRNGKey(9), (2, 2, 32), minval=0.5, maxval=2.0)
    k_int8 = jnp.round(k_float / token_scales[..., None]).astype(jnp.int8)
    v_int8 = jnp.round(v_float / token_scales[..., None]).astype(jnp.int8)
    q = jax.random.normal(jax.random.PRNGKey(10), (2, 4, 2, 32))
    scales = dict(
        k_scales=token_scales,
        v_scales=token_scales,
        k_channel_scales=channel_scales,
        v_channel_scales=channel_scales,
    )
    # Oracle: float pages holding the dequantised values, read per head through numpy.
    k_deq = attention.dequantize(k_int8, table, token_scales, channel_scales)
    v_deq = attention.dequantize(v_int8, table, token_scales, channel_scales)
    for backend in ("xla", *INTERPRETERS):
        out, _ = attention.paged_attention(
            q, k_int8, v_int8, table, lengths, sm_scale=0.2, backend=backend, **scales
        )
        for bi, ki in np.ndindex(2, 2):
            n = int(lengths[bi, ki])
            for g in range(2):
                for c in range(2):
                    head = ki * 2 + g
                    s = np.asarray(k_deq[bi, ki, :n]) @ np.asarray(q[bi, head, c]) * 0.2
                    p = np.exp(s - s.max()) if n else s
                    want = p / p.sum() @ np.asarray(v_deq[bi, ki, :n]) if n else 0.0
                    np.testing.assert_allclose(np.asarray(out[bi, head, c]), want, atol=1e-5)


def test_mass_from_probs_equals_direct_mass():
    k_pages, v_pages, table, lengths = _paged_inputs(11)
    q = jax.random.normal(jax.random.PRNGKey(12), (2, 4, 3, 32))
    _, part_lse, probs = attention.paged_attention(
        q, k_pages, v_pages, table, lengths, sm_scale=0.2, return_probs=True
    )
    total_lse = jnp.logaddexp(part_lse, 0.7)  # as if another key set added exp(0.7)
    weights = jnp.asarray([[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]])
    mass = attention.mass_from_probs(probs, part_lse, total_lse, weights, num_kv_heads=2)
    keys = np.asarray(attention.gather_pages(k_pages, table))
    want = np.zeros(mass.shape)
    for bi, ki in np.ndindex(2, 2):
        n = int(lengths[bi, ki])
        for g in range(2):
            for c in range(3):
                s = keys[bi, ki, :n] @ np.asarray(q[bi, ki * 2 + g, c]) * 0.2
                p = np.exp(s - float(total_lse[bi, ki * 2 + g, c]))
                want[bi, ki, :n] += float(weights[bi, c]) * p / 2
    np.testing.assert_allclose(np.asarray(mass), want, atol=1e-5)


CONFIG = tiny_config(max_position_embeddings=512)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=5, scale=0.3)


KERNEL_BACKENDS = [
    *INTERPRETERS,
    pytest.param("pallas", marks=pytest.mark.gpu, id="pallas-gpu"),
    pytest.param("pallas", marks=pytest.mark.tpu, id="pallas-tpu"),
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_forward_kernel_equals_xla(model, backend):
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 37), 0, 64)
    want = forward(model, tokens)
    got = forward(model, tokens, backend=backend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


@pytest.mark.parametrize(
    "policy",
    [policies.H2O(budget=24), policies.Quest(budget=16)],
    ids=lambda p: p.name,
)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_generate_kernel_equals_xla(model, policy, backend):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (45, 30)]
    kwargs = dict(
        max_new_tokens=4, policy=policy, cache=jaxkv.CacheConfig(page_size=4), prefill_chunk=16
    )
    want = jaxkv.generate(model, prompts, **kwargs)
    got = jaxkv.generate(model, prompts, backend=backend, **kwargs)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.pages_in_use, want.pages_in_use)
    np.testing.assert_allclose(
        np.asarray(got.state.token_scores()), np.asarray(want.state.token_scores()), atol=1e-5
    )
