"""Ragged paged decode kernels vs their jnp reference, and the reference vs a numpy token loop.

`TestPagedDecodeInterpret` runs the Triton kernel in the Pallas interpreter on CPU;
`TestPagedDecodeGpu` runs the same tests through Triton when a GPU is present;
`TestPagedDecodeMosaicInterpret` runs them through the TPU (Mosaic) kernel in the TPU interpreter,
`TestPagedDecodeTpu` compiled on a TPU when one is present.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import attention as jaxkv_attention
from jaxkv import pallas_kernels as pk
from jaxkv.pallas_kernels.paged_decode import ops as paged_decode_ops
from tests.pallas_kernels import brute_force
from tests.pallas_kernels.test_block_sparse import TOLERANCE, assert_close, assert_lse_close


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    page_size: int
    max_pages: int
    dtype: type
    block_sizes: pk.PagedDecodeBlockSizes

    @property
    def heads(self):
        return self.kv_heads * self.group

    @property
    def capacity(self):
        return self.max_pages * self.page_size


CASES = [
    Case(3, 2, 1, 64, 8, 6, jnp.float32, pk.PagedDecodeBlockSizes(2, 4)),
    Case(2, 2, 2, 128, 16, 5, jnp.bfloat16, pk.PagedDecodeBlockSizes(1, 2)),
    Case(3, 1, 4, 64, 16, 4, jnp.bfloat16, pk.PagedDecodeBlockSizes()),
    Case(1, 3, 8, 128, 8, 7, jnp.float32, pk.PagedDecodeBlockSizes(2, 2)),
]


def _lengths(case: Case, rng):
    """Ragged lengths covering 0, 1, p - 1, p, p + 1 and the capacity, shuffled over heads."""
    p = case.page_size
    special = np.array([0, 1, p - 1, p, p + 1, case.capacity])
    count = case.batch * case.kv_heads
    picks = np.concatenate([rng.permutation(special), rng.integers(0, case.capacity + 1, count)])
    return picks[:count].reshape(case.batch, case.kv_heads).astype(np.int32)


def _pool(case: Case, seed: int, pages_dtype=None):
    """A pool with spare pages, a permuted page table (-1 past each head's pages) and lengths."""
    rng = np.random.default_rng(seed)
    needed = case.batch * case.kv_heads * case.max_pages
    num_pages = needed + 5
    pool_shape = (num_pages, case.page_size, case.head_dim)
    k_pages, v_pages = rng.standard_normal(pool_shape), rng.standard_normal(pool_shape)
    lengths = _lengths(case, rng)
    table = rng.permutation(num_pages)[:needed].reshape(case.batch, case.kv_heads, -1)
    held_pages = -(-lengths // case.page_size)
    table = np.where(np.arange(case.max_pages) < held_pages[..., None], table, -1)
    q = rng.standard_normal((case.batch, case.heads, case.head_dim))
    dtype = pages_dtype or case.dtype
    return (
        jnp.asarray(q, case.dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(table, jnp.int32),
        jnp.asarray(lengths),
    )


def _quantize(pages, token_scales, channel_scales, page_table):
    """int8 pages whose values are `int8 * token_scale * channel_scale` for the table's owner."""
    pages = np.asarray(pages, np.float64)
    scale = np.ones(pages.shape)
    if token_scales is not None:
        scale = scale * np.asarray(token_scales)[..., None]
    if channel_scales is not None:
        table = np.asarray(page_table)
        for b, h, m in zip(*np.nonzero(table >= 0), strict=True):
            scale[table[b, h, m]] *= np.asarray(channel_scales)[b, h]
    return jnp.asarray(np.clip(np.round(pages / scale), -127, 127), jnp.int8)


class TestPagedDecodeInterpret:
    INTERPRET = True

    def decode(self, *args, **kwargs):
        return pk.paged_decode_attention(*args, interpret=self.INTERPRET, **kwargs)

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case: Case):
        q, k_pages, v_pages, table, lengths = _pool(case, seed=0)
        sm_scale = case.head_dim**-0.5
        out, stats = self.decode(
            q,
            k_pages,
            v_pages,
            table,
            lengths,
            sm_scale=sm_scale,
            return_stats=True,
            return_probs=True,
            block_sizes=case.block_sizes,
        )
        ref_out, ref_lse, ref_probs = pk.paged_decode_attention_reference(
            q, k_pages, v_pages, table, lengths, sm_scale=sm_scale
        )
        assert out.dtype == jnp.float32 and out.shape == q.shape
        assert stats.probs.shape == (case.batch, case.heads, case.capacity)
        tolerance = TOLERANCE[case.dtype]
        assert_close(out, ref_out, tolerance)
        assert_lse_close(stats.lse, ref_lse, tolerance)
        assert_close(stats.probs, ref_probs, tolerance)
        empty = np.repeat(np.asarray(lengths) == 0, case.group, axis=1)
        np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
        loop_out, loop_lse, loop_probs = brute_force.paged_decode(
            q, k_pages, v_pages, table, lengths, sm_scale=sm_scale
        )
        assert_close(ref_out, loop_out, 1e-5)
        assert_lse_close(ref_lse, loop_lse, 1e-5)
        assert_close(ref_probs, loop_probs, 1e-5)

    @pytest.mark.parametrize(
        "case,k_kinds,v_kinds",
        [
            (CASES[0], ("token", "channel"), ("token",)),
            (CASES[2], ("channel",), ("token", "channel")),
        ],
        ids=str,
    )
    def test_int8_pages(self, case: Case, k_kinds, v_kinds):
        q, k_pages, v_pages, table, lengths = _pool(case, seed=1, pages_dtype=jnp.float32)
        rng = np.random.default_rng(2)
        num_pages = k_pages.shape[0]

        def scales(kinds):
            token = (
                rng.uniform(0.01, 0.03, (num_pages, case.page_size)) if "token" in kinds else None
            )
            channel_shape = (case.batch, case.kv_heads, case.head_dim)
            channel = rng.uniform(0.5, 2.0, channel_shape) if "channel" in kinds else None
            return tuple(
                None if s is None else jnp.asarray(s, jnp.float32) for s in (token, channel)
            )

        (k_token, k_channel), (v_token, v_channel) = scales(k_kinds), scales(v_kinds)
        k_int8 = _quantize(k_pages, k_token, k_channel, table)
        v_int8 = _quantize(v_pages, v_token, v_channel, table)
        quant = dict(
            k_scales=k_token,
            v_scales=v_token,
            k_channel_scales=k_channel,
            v_channel_scales=v_channel,
        )
        sm_scale = case.head_dim**-0.5
        out, stats = self.decode(
            q,
            k_int8,
            v_int8,
            table,
            lengths,
            sm_scale=sm_scale,
            return_stats=True,
            block_sizes=case.block_sizes,
            **quant,
        )
        ref_out, ref_lse, _ = pk.paged_decode_attention_reference(
            q, k_int8, v_int8, table, lengths, sm_scale=sm_scale, **quant
        )
        assert stats.probs is None
        assert_close(out, ref_out, TOLERANCE[case.dtype])
        assert_lse_close(stats.lse, ref_lse, TOLERANCE[case.dtype])
        loop_out, loop_lse, _ = brute_force.paged_decode(
            q, k_int8, v_int8, table, lengths, sm_scale=sm_scale, **quant
        )
        assert_close(ref_out, loop_out, 1e-5)
        assert_lse_close(ref_lse, loop_lse, 1e-5)

    def test_chunk_rows_match_jaxkv_paged_attention(self):
        """A chunk of C queries folded into the head axis equals jaxkv's xla paged attention."""
        case, chunk = CASES[1], 3
        _, k_pages, v_pages, table, lengths = _pool(case, seed=3)
        rng = np.random.default_rng(4)
        q = jnp.asarray(rng.standard_normal((case.batch, case.heads, chunk, case.head_dim)))
        q = q.astype(case.dtype)
        out, stats = self.decode(
            q.reshape(case.batch, case.heads * chunk, case.head_dim),
            k_pages,
            v_pages,
            table,
            lengths,
            sm_scale=0.1,
            return_stats=True,
            block_sizes=case.block_sizes,
        )
        want_out, want_lse = jaxkv_attention.paged_attention(
            q, k_pages, v_pages, table, lengths, sm_scale=0.1
        )
        assert_close(out.reshape(want_out.shape), want_out, TOLERANCE[case.dtype])
        assert_lse_close(stats.lse.reshape(want_lse.shape), want_lse, TOLERANCE[case.dtype])

    def test_ring_merges_through_lse_under_jit(self):
        """The documented second segment: a dense ring attended separately and merged by lse
        equals attention over pages and ring together (traced lengths, inside jit)."""
        case, window = CASES[3], 5
        q, k_pages, v_pages, table, lengths = _pool(case, seed=5)
        rng = np.random.default_rng(6)
        ring_shape = (case.batch, case.kv_heads, window, case.head_dim)
        ring_k = jnp.asarray(rng.standard_normal(ring_shape), case.dtype)
        ring_v = jnp.asarray(rng.standard_normal(ring_shape), case.dtype)
        ring_lengths = jnp.asarray(rng.integers(0, window + 1, ring_shape[:2]), jnp.int32)

        @jax.jit
        def merged(lengths, ring_lengths):
            out, stats = self.decode(
                q,
                k_pages,
                v_pages,
                table,
                lengths,
                sm_scale=0.2,
                return_stats=True,
                block_sizes=case.block_sizes,
            )
            ring_held = jnp.arange(window) < ring_lengths[..., None]
            ring_out, ring_lse = jaxkv_attention.masked_attention(
                q[:, :, None], ring_k, ring_v, ring_held[:, :, None, None, :], 0.2
            )
            return jaxkv_attention.merge_partials(
                out, stats.lse, ring_out[:, :, 0], ring_lse[..., 0]
            )

        out, lse = merged(lengths, ring_lengths)
        # Everything in one dense attention: cached tokens then ring slots.
        cached_k = jaxkv_attention.gather_pages(k_pages, table)
        cached_v = jaxkv_attention.gather_pages(v_pages, table)
        keys = jnp.concatenate([cached_k, ring_k], axis=2)
        values = jnp.concatenate([cached_v, ring_v], axis=2)
        slot = jnp.arange(keys.shape[2])
        held = (slot < lengths[..., None]) | (
            (slot >= case.capacity) & (slot - case.capacity < ring_lengths[..., None])
        )
        want_out, want_lse = jaxkv_attention.masked_attention(
            q[:, :, None], keys, values, held[:, :, None, None, :], 0.2
        )
        assert_close(out, want_out[:, :, 0], TOLERANCE[case.dtype])
        assert_lse_close(lse, want_lse[..., 0], TOLERANCE[case.dtype])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.usefixtures("full_precision_references")
class TestPagedDecodeGpu(TestPagedDecodeInterpret):
    INTERPRET = False


class TestPagedDecodeMosaicInterpret(TestPagedDecodeInterpret):
    """The TPU kernel in the TPU interpreter (its DMAs and semaphores simulated on the CPU)."""

    def decode(self, *args, block_sizes=None, **kwargs):
        del block_sizes  # the Triton kernel's tiles
        return pk.paged_decode_attention(*args, target="mosaic", interpret=self.INTERPRET, **kwargs)


@pytest.mark.tpu
@pytest.mark.usefixtures("full_precision_references")
class TestPagedDecodeTpu(TestPagedDecodeMosaicInterpret):
    """The TPU kernel compiled by Mosaic on a TPU."""

    INTERPRET = False


def _valid_call(**overrides):
    case = CASES[0]
    q, k_pages, v_pages, table, lengths = _pool(case, seed=0)
    args = dict(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=table,
        lengths=lengths,
        sm_scale=0.1,
        interpret=True,
    )
    args.update(overrides)
    return [args.pop(n) for n in ("q", "k_pages", "v_pages", "page_table", "lengths")], args


INT8_POOL = jnp.zeros((41, 8, 64), jnp.int8)  # the pool of CASES[0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"q": jnp.zeros((3, 2, 1, 64))}, "q must"),
        ({"q": jnp.zeros((3, 2, 64), jnp.int32)}, "q must"),
        ({"k_pages": jnp.zeros((41, 8, 64), jnp.int16)}, "k_pages must"),
        ({"v_pages": jnp.zeros((41, 8, 32))}, "v_pages shape"),
        ({"k_pages": jnp.zeros((41, 8, 32)), "v_pages": jnp.zeros((41, 8, 32))}, "head dim"),
        (
            {
                "q": jnp.zeros((3, 2, 48)),
                "k_pages": jnp.zeros((41, 8, 48)),
                "v_pages": jnp.zeros((41, 8, 48)),
            },
            "head_dim",
        ),
        ({"k_pages": jnp.zeros((41, 12, 64)), "v_pages": jnp.zeros((41, 12, 64))}, "page_size"),
        ({"page_table": np.zeros((3, 2, 6), np.int64)}, "page_table"),
        ({"page_table": jnp.zeros((2, 2, 6), jnp.int32)}, "page_table"),
        ({"q": jnp.zeros((3, 3, 64))}, "N=3"),
        ({"lengths": jnp.zeros((3, 1), jnp.int32)}, "lengths"),
        ({"lengths": jnp.full((3, 2), 49, jnp.int32)}, r"lengths must lie in \[0, 48\]"),
        ({"lengths": jnp.full((3, 2), -1, jnp.int32)}, "lengths must lie"),
        ({"k_pages": INT8_POOL}, "k_pages is int8"),
        ({"v_scales": jnp.ones((41, 8))}, "v_scales apply to int8 pages"),
        ({"k_pages": INT8_POOL, "k_scales": jnp.ones((41, 4))}, r"k_scales must be f32\[41, 8\]"),
        ({"k_pages": INT8_POOL, "k_channel_scales": jnp.ones((3, 2, 32))}, "k_channel_scales"),
        ({"return_probs": True}, "return_stats"),
        ({"block_sizes": pk.PagedDecodeBlockSizes(pages_per_block=3)}, "pages_per_block"),
        ({"block_sizes": pk.PagedDecodeBlockSizes(4, 2)}, "pages_per_split"),
        ({"block_sizes": pk.PagedDecodeBlockSizes(1, 4)}, "at least 16 keys"),
        ({"block_sizes": pk.PagedDecodeBlockSizes(block_h=8)}, "block_h"),
        ({"target": "tpu"}, r"target='tpu': allowed are 'triton', 'mosaic'"),
        (
            {"target": "mosaic", "block_sizes": pk.PagedDecodeBlockSizes()},
            "block_sizes tile the Triton kernel",
        ),
    ],
)
def test_bad_inputs_name_the_argument(overrides, message):
    positional, keywords = _valid_call(**overrides)
    with pytest.raises(ValueError, match=message):
        pk.paged_decode_attention(*positional, **keywords)


def test_int8_pool_in_the_int32_offset_gap_is_refused():
    positional, keywords = _valid_call()
    q, _, _, table, lengths = positional
    huge = jax.ShapeDtypeStruct((2**31 // (8 * 64), 8, 64), jnp.int8)  # 2^31 elements
    scales = jax.ShapeDtypeStruct(huge.shape[:2], jnp.float32)

    def call(k_pages, v_pages, k_scales, v_scales):
        return pk.paged_decode_attention(
            q, k_pages, v_pages, table, lengths, k_scales=k_scales, v_scales=v_scales, **keywords
        )

    with pytest.raises(ValueError, match="int8 k_pages of 2147483648 elements"):
        jax.eval_shape(call, huge, huge, scales, scales)
    wraps = paged_decode_ops.offsets_would_wrap
    assert not wraps(jax.ShapeDtypeStruct(huge.shape, jnp.bfloat16))  # int32 offsets suffice
    assert not wraps(jax.ShapeDtypeStruct((2**32 // 512 + 1, 8, 64), jnp.int8))  # int64 offsets
    assert not wraps(jax.ShapeDtypeStruct((2**31 // 512 - 1, 8, 64), jnp.int8))
