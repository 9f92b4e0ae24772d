"""Block-sparse prefill kernel vs its jnp reference, and the reference vs a numpy row loop.

`TestBlockSparseInterpret` runs the Pallas interpreter on CPU; `TestBlockSparseGpu` runs the same
tests through Triton when a GPU is present.
"""

import dataclasses
import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import pallas_kernels as pk
from tests.pallas_kernels import brute_force

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    group: int
    tokens: int
    head_dim: int
    block_q: int
    block_k: int
    dtype: type
    lists_per_query_head: bool
    band: int | None = None  # a gate bias is used when set

    @property
    def heads(self):
        return self.kv_heads * self.group

    @property
    def num_key_blocks(self):
        return -(-self.tokens // self.block_k)

    @property
    def num_query_blocks(self):
        return -(-self.tokens // self.block_q)

    @property
    def list_heads(self):
        return self.heads if self.lists_per_query_head else self.kv_heads

    def tiles(self):
        return {"block_q": self.block_q, "block_k": self.block_k}


CASES = [
    Case(2, 2, 1, 64, 64, 16, 16, jnp.float32, False),
    Case(1, 2, 2, 50, 128, 16, 32, jnp.bfloat16, True, band=7),
    Case(1, 1, 4, 77, 64, 32, 16, jnp.bfloat16, False),
    Case(1, 1, 8, 40, 128, 16, 16, jnp.float32, True, band=0),
]


def _inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.batch, case.heads, case.tokens, case.head_dim))
    kv_shape = (case.batch, case.kv_heads, case.tokens, case.head_dim)
    k, v = rng.standard_normal(kv_shape), rng.standard_normal(kv_shape)
    q, k, v = (jnp.asarray(x, case.dtype) for x in (q, k, v))
    gate_bias = None
    if case.band is not None:
        gate_bias = jnp.asarray(np.log(rng.uniform(0.05, 1.0, kv_shape[:3])), jnp.float32)
    return q, k, v, gate_bias


def _random_lists(case: Case, seed: int):
    """Random lists (blocks above the diagonal included), some query blocks listing nothing, and
    garbage past each count."""
    rng = np.random.default_rng(seed)
    shape = (case.batch, case.list_heads, case.num_query_blocks, case.num_key_blocks)
    listed = rng.random(shape) < 0.6
    listed[..., 0, :] = False  # rows that see nothing
    idx, cnt = (np.asarray(x) for x in pk.block_lists_from_mask(listed))
    garbage = rng.integers(-3, case.num_key_blocks + 3, idx.shape)
    idx = np.where(np.arange(idx.shape[-1]) < cnt[..., None], idx, garbage)
    return jnp.asarray(idx, jnp.int32), jnp.asarray(cnt, jnp.int32)


def assert_close(actual, expected, tolerance):
    """Max-abs error within `tolerance`, relative to the expected magnitude when that exceeds 1."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    error = np.max(np.abs(actual - expected), initial=0.0)
    scale = max(1.0, np.max(np.abs(expected), initial=0.0))
    assert error <= tolerance * scale, f"max abs error {error:.3g} (scale {scale:.3g})"


def assert_lse_close(actual, expected, tolerance):
    actual, expected = np.asarray(actual), np.asarray(expected)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert_close(actual[finite], expected[finite], tolerance)


def _loss_weights(case: Case):
    rng = np.random.default_rng(7)
    out_weight = rng.standard_normal((case.batch, case.heads, case.tokens, case.head_dim))
    lse_weight = rng.standard_normal((case.batch, case.heads, case.tokens))
    return jnp.asarray(out_weight, jnp.float32), jnp.asarray(lse_weight, jnp.float32)


def _loss(attention, out_weight, lse_weight):
    """A scalar of both outputs, so that out and lse cotangents are exercised."""

    def loss(q, k, v, gate_bias):
        out, lse = attention(q, k, v, gate_bias)
        lse_term = jnp.where(jnp.isfinite(lse), lse * lse_weight, 0.0)
        return jnp.sum(out.astype(jnp.float32) * out_weight) + jnp.sum(lse_term)

    return loss


class TestBlockSparseInterpret:
    INTERPRET = True

    def attention(self, case: Case, kv_block_idx, kv_block_cnt, sm_scale):
        def run(q, k, v, gate_bias):
            return pk.block_sparse_attention(
                q,
                k,
                v,
                kv_block_idx,
                kv_block_cnt,
                sm_scale=sm_scale,
                gate_bias=gate_bias,
                band=case.band,
                return_lse=True,
                interpret=self.INTERPRET,
                **case.tiles(),
            )

        return run

    def reference(self, case: Case, kv_block_idx, kv_block_cnt, sm_scale):
        def run(q, k, v, gate_bias):
            return pk.block_sparse_attention_reference(
                q,
                k,
                v,
                kv_block_idx,
                kv_block_cnt,
                sm_scale=sm_scale,
                gate_bias=gate_bias,
                band=case.band,
                **case.tiles(),
            )

        return run

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_forward(self, case: Case):
        q, k, v, gate_bias = _inputs(case, seed=0)
        idx, cnt = _random_lists(case, seed=1)
        sm_scale = case.head_dim**-0.5
        out, lse = self.attention(case, idx, cnt, sm_scale)(q, k, v, gate_bias)
        ref_out, ref_lse = self.reference(case, idx, cnt, sm_scale)(q, k, v, gate_bias)
        assert out.dtype == case.dtype and lse.dtype == jnp.float32
        assert_close(out, ref_out, TOLERANCE[case.dtype])
        assert_lse_close(lse, ref_lse, TOLERANCE[case.dtype])
        # Rows that see nothing (query block 0 lists nothing) are exactly 0.
        assert not np.any(np.isnan(np.asarray(out, np.float32)))
        np.testing.assert_array_equal(np.asarray(out[:, :, : case.block_q], np.float32), 0.0)
        # The reference itself, against a float64 row loop.
        loop_out, loop_lse = brute_force.block_sparse(
            q,
            k,
            v,
            idx,
            cnt,
            sm_scale=sm_scale,
            gate_bias=gate_bias,
            band=case.band,
            **case.tiles(),
        )
        assert_close(ref_out, loop_out, 1e-5)
        assert_lse_close(ref_lse, loop_lse, 1e-5)

    @pytest.mark.parametrize("case", [CASES[2]], ids=str)
    def test_dense_lists_match_causal_attention(self, case: Case):
        q, k, v, _ = _inputs(case, seed=2)
        idx, cnt = pk.dense_causal_block_lists(
            case.batch, case.list_heads, case.tokens, **case.tiles()
        )
        out = pk.block_sparse_attention(
            q, k, v, idx, cnt, sm_scale=0.1, interpret=self.INTERPRET, **case.tiles()
        )
        expected = jax.nn.dot_product_attention(
            *(jnp.swapaxes(x, 1, 2).astype(jnp.float32) for x in (q, k, v)),
            scale=0.1,
            is_causal=True,
        )
        assert_close(out, jnp.swapaxes(expected, 1, 2), TOLERANCE[case.dtype])

    @pytest.mark.parametrize(
        "case",
        [
            Case(1, 2, 2, 50, 64, 16, 32, jnp.float32, True, band=3),
            Case(1, 1, 4, 64, 128, 16, 16, jnp.bfloat16, False),
        ],
        ids=str,
    )
    def test_gradients_match_reference(self, case: Case):
        q, k, v, gate_bias = _inputs(case, seed=3)
        idx, cnt = _random_lists(case, seed=4)
        sm_scale = case.head_dim**-0.5
        weights = _loss_weights(case)
        argnums = (0, 1, 2, 3) if gate_bias is not None else (0, 1, 2)
        kernel_loss = _loss(self.attention(case, idx, cnt, sm_scale), *weights)
        reference_loss = _loss(self.reference(case, idx, cnt, sm_scale), *weights)
        grads = jax.grad(kernel_loss, argnums)(q, k, v, gate_bias)
        expected = jax.grad(reference_loss, argnums)(q, k, v, gate_bias)
        for name, grad, want in zip("q k v gate_bias".split(), grads, expected, strict=False):
            assert grad.dtype == want.dtype, name
            assert not np.any(np.isnan(np.asarray(grad, np.float32))), name
            assert_close(grad, want, TOLERANCE[case.dtype])

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(data=st.data())
    def test_random_block_lists(self, data):
        case = HYPOTHESIS_CASE
        shape = (case.batch, case.list_heads, case.num_query_blocks, case.num_key_blocks)
        listed = data.draw(hnp.arrays(np.bool_, shape), label="listed")
        entries = data.draw(st.integers(1, case.num_key_blocks), label="entries")
        idx, cnt = pk.block_lists_from_mask(listed, entries)
        q, k, v, gate_bias = _inputs(case, seed=5)
        sm_scale = case.head_dim**-0.5
        # Traced lists (the op inside a caller's jit); one compile serves every list length.
        padded_idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, shape[-1] - entries)))
        out, lse = _jitted_attention(self.INTERPRET)(q, k, v, gate_bias, padded_idx, cnt)
        ref_out, ref_lse = self.reference(case, idx, cnt, sm_scale)(q, k, v, gate_bias)
        assert_close(out, ref_out, TOLERANCE[case.dtype])
        assert_lse_close(lse, ref_lse, TOLERANCE[case.dtype])


HYPOTHESIS_CASE = Case(1, 2, 2, 72, 64, 16, 16, jnp.float32, True, band=9)


@functools.cache
def _jitted_attention(interpret: bool):
    case = HYPOTHESIS_CASE

    def run(q, k, v, gate_bias, kv_block_idx, kv_block_cnt):
        return pk.block_sparse_attention(
            q,
            k,
            v,
            kv_block_idx,
            kv_block_cnt,
            sm_scale=case.head_dim**-0.5,
            gate_bias=gate_bias,
            band=case.band,
            return_lse=True,
            interpret=interpret,
            **case.tiles(),
        )

    return jax.jit(run)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.usefixtures("full_precision_references")
class TestBlockSparseGpu(TestBlockSparseInterpret):
    INTERPRET = False


def _valid_call(**overrides):
    case = Case(1, 2, 2, 40, 64, 16, 16, jnp.float32, False)
    q, k, v, _ = _inputs(case, seed=0)
    idx, cnt = pk.dense_causal_block_lists(1, 2, 40, block_q=16, block_k=16)
    args = dict(
        q=q,
        k=k,
        v=v,
        kv_block_idx=idx,
        kv_block_cnt=cnt,
        sm_scale=0.1,
        block_q=16,
        block_k=16,
        interpret=True,
    )
    args.update(overrides)
    return args


def _positional(args):
    return [args.pop(name) for name in ("q", "k", "v", "kv_block_idx", "kv_block_cnt")]


@pytest.mark.parametrize(
    "overrides,argument",
    [
        ({"q": jnp.zeros((4, 40, 64))}, "q must"),
        ({"k": jnp.zeros((1, 2, 40, 64), jnp.bfloat16)}, "k must"),
        ({"v": jnp.zeros((1, 2, 41, 64))}, "v shape"),
        ({"q": jnp.zeros((1, 3, 40, 64))}, "N=3"),
        (
            {
                "q": jnp.zeros((1, 4, 40, 48)),
                "k": jnp.zeros((1, 2, 40, 48)),
                "v": jnp.zeros((1, 2, 40, 48)),
            },
            "head_dim",
        ),
        ({"block_q": 24}, "block_q"),
        ({"block_k": 8}, "block_k"),
        ({"block_q": 32}, "kv_block_idx"),
        ({"kv_block_idx": jnp.zeros((1, 3, 3, 3), jnp.int32)}, "kv_block_idx"),
        ({"kv_block_cnt": np.zeros((1, 2, 3), np.int64)}, "kv_block_cnt"),
        ({"kv_block_cnt": jnp.full((1, 2, 3), 4, jnp.int32)}, "kv_block_cnt"),
        ({"kv_block_idx": jnp.full((1, 2, 3, 3), 3, jnp.int32)}, "kv_block_idx"),
        ({"kv_block_idx": jnp.zeros((1, 2, 3, 3), jnp.int32)}, "ascending"),
        ({"gate_bias": jnp.zeros((1, 2, 40))}, "band"),
        ({"gate_bias": jnp.zeros((1, 4, 40)), "band": 2}, "gate_bias"),
        ({"band": 2}, "band"),
    ],
)
def test_bad_inputs_name_the_argument(overrides, argument):
    args = _valid_call(**overrides)
    with pytest.raises(ValueError, match=argument):
        pk.block_sparse_attention(*_positional(args), **args)
