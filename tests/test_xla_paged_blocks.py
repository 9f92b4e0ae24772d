"""The XLA paged path reads block by block up to the longest head, and nothing past `lengths`.

Tables here span several blocks (`XLA_BLOCK_TOKENS`), with NaN everywhere a head does not hold
a token: in unused pages, in the tail of each head's last page and in pages the table lists past
a head's length. The result must equal attention over exactly the held tokens, computed plainly
in float64 numpy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import attention
from jaxkv.attention import paged
from jaxkv.attention.paged import paged_attention, xla_block_pages, xla_blocks_read

PAGE = 16


def _pool_and_table(rng, lengths: np.ndarray, entries: int, head_dim: int):
    """A pool with each head's pages scattered at random, NaN wherever no token is held."""
    b, k = lengths.shape
    num_pages = b * k * entries + 3
    order = rng.permutation(num_pages)
    table = order[: b * k * entries].reshape(b, k, entries).astype(np.int32)
    k_pages = np.full((num_pages, PAGE, head_dim), np.nan, np.float32)
    v_pages = np.full((num_pages, PAGE, head_dim), np.nan, np.float32)
    keys = rng.standard_normal((b, k, entries * PAGE, head_dim)).astype(np.float32)
    values = rng.standard_normal((b, k, entries * PAGE, head_dim)).astype(np.float32)
    for i in range(b):
        for j in range(k):
            for t in range(lengths[i, j]):
                page, slot = table[i, j, t // PAGE], t % PAGE
                k_pages[page, slot], v_pages[page, slot] = keys[i, j, t], values[i, j, t]
    return k_pages, v_pages, table, keys, values


def _reference(q, keys, values, lengths, sm_scale):
    """out [B, N, C, H], lse [B, N, C], probs [B, N, C, S] over held tokens, in float64."""
    b, n, c, _ = q.shape
    k = keys.shape[1]
    g = n // k
    out = np.zeros(q.shape)
    lse = np.full((b, n, c), -np.inf)
    probs = np.zeros((b, n, c, keys.shape[2]))
    for i in range(b):
        for head in range(n):
            held = lengths[i, head // g]
            if held == 0:
                continue
            kk = keys[i, head // g, :held].astype(np.float64)
            vv = values[i, head // g, :held].astype(np.float64)
            s = q[i, head].astype(np.float64) @ kk.T * sm_scale
            top = s.max(-1, keepdims=True)
            e = np.exp(s - top)
            lse[i, head] = (top + np.log(e.sum(-1, keepdims=True)))[:, 0]
            p = e / e.sum(-1, keepdims=True)
            out[i, head], probs[i, head, :, :held] = p @ vv, p
    return out, lse, probs


@pytest.mark.parametrize(
    ("chunk", "lengths"), [(1, [[0, 700], [1100, 37]]), (5, [[513, 512], [1, 1280]])]
)
def test_blocks_equal_attention_over_the_held_tokens(chunk, lengths):
    rng = np.random.default_rng(chunk)
    lengths = np.asarray(lengths, np.int32)
    entries, head_dim, heads = 80, 32, 4  # 1280 tokens of table: 3 blocks of 512
    k_pages, v_pages, table, keys, values = _pool_and_table(rng, lengths, entries, head_dim)
    q = rng.standard_normal((2, heads, chunk, head_dim)).astype(np.float32)
    sm_scale = head_dim**-0.5
    out, lse, probs = paged_attention(
        jnp.asarray(q), k_pages, v_pages, table, lengths, sm_scale=sm_scale, return_probs=True
    )
    want_out, want_lse, want_probs = _reference(q, keys, values, lengths, sm_scale)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(probs), want_probs, atol=2e-7, rtol=1e-5)


def test_blocks_read_follow_the_longest_head_not_the_table_width():
    assert xla_block_pages(entries=80, page_size=PAGE) * PAGE == paged.XLA_BLOCK_TOKENS
    for longest, blocks in ((0, 0), (1, 1), (512, 1), (513, 2), (1100, 3)):
        lengths = jnp.asarray([[longest, min(longest, 3)], [min(longest, 7), 0]])
        assert int(xla_blocks_read(lengths, entries=256, page_size=PAGE)) == blocks
    assert int(xla_blocks_read(jnp.asarray([[20]]), entries=2, page_size=PAGE)) == 1
    # A wide table (128K tokens) has at most XLA_MAX_BLOCKS blocks, each longer.
    wide = 8192
    assert -(-wide // xla_block_pages(wide, PAGE)) == paged.XLA_MAX_BLOCKS
    # Between powers of two (tables come in 8 widths per octave) blocks stay a power of two
    # times the base, so a prompt of 8192 tokens fills 8 of them, not 14.2 blocks of width / 16.
    base = paged.XLA_BLOCK_TOKENS // PAGE
    for entries in (576, 640, 1152, 4608, 9216):
        block = xla_block_pages(entries, PAGE)
        assert block % base == 0 and (block // base) & (block // base - 1) == 0, (entries, block)
        assert -(-entries // block) <= paged.XLA_MAX_BLOCKS
        assert -(-entries // (block // 2)) > paged.XLA_MAX_BLOCKS, (entries, block)
    assert int(xla_blocks_read(jnp.asarray([[8192]]), entries=576, page_size=PAGE)) == 8
    assert int(xla_blocks_read(jnp.asarray([[9000]]), entries=wide, page_size=PAGE)) == 2


def test_a_skipped_block_costs_nothing_outside_its_branch():
    """Every block's work, the merge into the running output included, lies inside the block's
    `cond`: at the top of the program nothing is computed per block, so a wide table (a request
    with room to generate) costs a prefill chunk no more than a narrow one."""
    import jax

    rng = np.random.default_rng(0)
    lengths = np.asarray([[600, 40]])
    for entries in (64, 256):  # 2 and 8 blocks
        k_pages, v_pages, table, _, _ = _pool_and_table(rng, lengths, entries, 8)
        q = rng.standard_normal((1, 4, 32, 8)).astype(np.float32)
        jaxpr = jax.make_jaxpr(
            lambda q, kp, vp, t, n: paged_attention(q, kp, vp, t, n, sm_scale=0.3, backend="xla")
        )(q, k_pages, v_pages, table, lengths).jaxpr
        eqns = _outside_branches(jaxpr)
        top_level = {eqn.primitive.name for eqn in eqns}
        assert not top_level & {"exp", "log", "dot_general", "gather"}, top_level
        blocks = -(-entries // xla_block_pages(entries, PAGE))
        assert sum(eqn.primitive.name == "cond" for eqn in eqns) == blocks


def _outside_branches(jaxpr) -> list:
    """The equations of a jaxpr and of the jitted calls in it, not those inside a cond."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        if eqn.primitive.name in ("jit", "pjit"):
            found += _outside_branches(eqn.params["jaxpr"].jaxpr)
    return found


def test_quest_selection_reads_the_selected_pages_only():
    rng = np.random.default_rng(3)
    lengths = np.asarray([[900, 600]], np.int32)
    k_pages, v_pages, table, keys, values = _pool_and_table(rng, lengths, 64, 16)
    mask = rng.random((1, 2, 64)) < 0.4
    mask[0, 0, (900 - 1) // PAGE] = True  # a head's partial last page among the selected
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    out, lse = paged_attention(
        jnp.asarray(q), k_pages, v_pages, table, lengths, sm_scale=0.25, page_mask=mask
    )
    for head in range(2):
        held = np.arange(lengths[0, head])
        chosen = held[mask[0, head, held // PAGE]]
        s = q[0, head, 0].astype(np.float64) @ keys[0, head, chosen].T * 0.25
        p = np.exp(s - s.max())
        want = p @ values[0, head, chosen] / p.sum()
        np.testing.assert_allclose(np.asarray(out)[0, head, 0], want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("chunk", "lengths"), [(7, [[0, 700], [1100, 37]]), (3, [[513, 512], [1, 1280]])]
)
def test_block_mass_equals_the_mass_of_the_held_tokens(chunk, lengths):
    """`paged_attention_mass` (the chunk's mass recomputed block by block) against float64:
    sum over weighted queries of exp(score - total_lse), mean over the group; total_lse here
    is over the cached tokens and one extra logit per query (as a chunk's own keys add)."""
    rng = np.random.default_rng(10 + chunk)
    lengths = np.asarray(lengths, np.int32)
    entries, head_dim, heads = 80, 32, 4
    k_pages, _, table, keys, values = _pool_and_table(rng, lengths, entries, head_dim)
    q = rng.standard_normal((2, heads, chunk, head_dim)).astype(np.float32)
    sm_scale = head_dim**-0.5
    _, cached_lse, probs = _reference(q, keys, values, lengths, sm_scale)
    extra = rng.standard_normal((2, heads, chunk))  # the rest of what the queries saw
    total_lse = np.logaddexp(cached_lse, extra)
    weights = rng.uniform(0, 1, (2, chunk)).astype(np.float32)
    probs_total = (
        probs * np.exp(np.where(np.isfinite(cached_lse), cached_lse - total_lse, 0))[..., None]
    )
    group = heads // lengths.shape[1]
    want = (probs_total * weights[:, None, :, None]).reshape(2, 2, group, chunk, -1)
    want = want.sum(axis=(2, 3)) / group
    got = paged.paged_attention_mass(
        jnp.asarray(q),
        k_pages,
        table,
        lengths,
        jnp.asarray(total_lse, jnp.float32),
        jnp.asarray(weights),
        sm_scale=sm_scale,
    )
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-5)


def test_block_mass_equals_the_probabilities_mass_with_int8_scales():
    """With int8 pages and both scales, the second pass equals `mass_from_probs` of the one-pass
    probabilities (what the kernels and single queries use)."""
    rng = np.random.default_rng(3)
    lengths = np.asarray([[600, 90], [1030, 0]], np.int32)
    entries, head_dim, heads, chunk = 80, 32, 4, 5
    k_pages, v_pages, table, _, _ = _pool_and_table(rng, lengths, entries, head_dim)
    k_int8 = np.nan_to_num(np.clip(np.round(k_pages * 40), -127, 127)).astype(np.int8)
    v_int8 = np.nan_to_num(np.clip(np.round(v_pages * 40), -127, 127)).astype(np.int8)
    token_scales = rng.uniform(0.01, 0.03, k_pages.shape[:2]).astype(np.float32)
    channel_scales = rng.uniform(0.5, 1.5, (2, 2, head_dim)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((2, heads, chunk, head_dim)).astype(np.float32))
    scales = dict(k_scales=token_scales, k_channel_scales=channel_scales)
    _, lse, probs = paged_attention(
        q,
        k_int8,
        v_int8,
        table,
        lengths,
        sm_scale=0.2,
        v_scales=token_scales,
        v_channel_scales=channel_scales,
        return_probs=True,
        **scales,
    )
    total_lse = jnp.logaddexp(lse, 0.5)
    weights = jnp.asarray(rng.uniform(0, 1, (2, chunk)).astype(np.float32))
    want = attention.mass_from_probs(probs, lse, total_lse, weights, num_kv_heads=2)
    got = paged.paged_attention_mass(
        q, k_int8, table, lengths, total_lse, weights, sm_scale=0.2, **scales
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)
