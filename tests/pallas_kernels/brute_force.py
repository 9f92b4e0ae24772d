"""Independent numpy oracles, one query row at a time in float64: the references' references."""

import numpy as np


def _softmax_row(scores: np.ndarray, values: np.ndarray):
    """Output and logsumexp of one row over its visible keys (0 and -inf when there are none)."""
    if scores.size == 0:
        return np.zeros(values.shape[-1]), -np.inf, scores
    top = scores.max()
    weights = np.exp(scores - top)
    total = weights.sum()
    return weights @ values / total, top + np.log(total), weights / total


def block_sparse(
    q, k, v, kv_block_idx, kv_block_cnt, *, sm_scale, block_q, block_k, gate_bias=None, band=None
):
    """Block-sparse causal attention row by row: out f64 [B, N, T, H], lse f64 [B, N, T]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    idx, cnt = np.asarray(kv_block_idx), np.asarray(kv_block_cnt)
    batch, num_heads, num_tokens, _ = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(batch):
        for n in range(num_heads):
            kv_head = n // group
            list_head = n if idx.shape[1] == num_heads else kv_head
            for i in range(num_tokens):
                qb = i // block_q
                listed = set(idx[b, list_head, qb, : cnt[b, list_head, qb]].tolist())
                keys = [j for j in range(i + 1) if j // block_k in listed]
                scores = np.array([q[b, n, i] @ k[b, kv_head, j] * sm_scale for j in keys])
                if gate_bias is not None:
                    scores += [gate_bias[b, kv_head, j] if i - j >= band else 0.0 for j in keys]
                out[b, n, i], lse[b, n, i], _ = _softmax_row(scores, v[b, kv_head, keys])
    return out, lse


def paged_decode(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    sm_scale,
    k_scales=None,
    v_scales=None,
    k_channel_scales=None,
    v_channel_scales=None,
):
    """Paged decode token by token: out f64 [B, N, H], lse [B, N], probs [B, N, M * p]."""
    q = np.asarray(q, np.float64)
    table, lengths = np.asarray(page_table), np.asarray(lengths)
    batch, num_heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    group = num_heads // table.shape[1]

    def token(pages, token_scales, channel_scales, b, h, t):
        page, slot = table[b, h, t // page_size], t % page_size
        value = np.asarray(pages[page, slot], np.float64)
        if token_scales is not None:
            value = value * float(token_scales[page, slot])
        if channel_scales is not None:
            value = value * np.asarray(channel_scales[b, h], np.float64)
        return value

    out = np.zeros(q.shape)
    lse = np.full((batch, num_heads), -np.inf)
    probs = np.zeros((batch, num_heads, table.shape[2] * page_size))
    for b in range(batch):
        for n in range(num_heads):
            h = n // group
            held = range(lengths[b, h])
            keys = np.array([token(k_pages, k_scales, k_channel_scales, b, h, t) for t in held])
            values = np.array([token(v_pages, v_scales, v_channel_scales, b, h, t) for t in held])
            scores = keys @ q[b, n] * sm_scale if len(held) else np.zeros(0)
            values = values.reshape(len(held), head_dim)
            out[b, n], lse[b, n], row_probs = _softmax_row(scores, values)
            probs[b, n, : len(held)] = row_probs
    return out, lse, probs


def block_mask_of_token_mask(token_mask: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """bool [..., nq, nkb]: blocks holding at least one admitted (query, key) pair."""
    *lead, num_tokens, _ = token_mask.shape
    nq, nkb = -(-num_tokens // block_q), -(-num_tokens // block_k)
    blocks = np.zeros((*lead, nq, nkb), bool)
    for qb in range(nq):
        for kb in range(nkb):
            tile = token_mask[
                ..., qb * block_q : (qb + 1) * block_q, kb * block_k : (kb + 1) * block_k
            ]
            blocks[..., qb, kb] = tile.any(axis=(-1, -2))
    return blocks


def block_mask_of_lists(kv_block_idx, kv_block_cnt, num_key_blocks: int) -> np.ndarray:
    """bool [..., nq, nkb] from lists, checking the list invariants on the way."""
    idx, cnt = np.asarray(kv_block_idx), np.asarray(kv_block_cnt)
    blocks = np.zeros((*idx.shape[:-1], num_key_blocks), bool)
    for pos in np.ndindex(*idx.shape[:-1]):
        valid = idx[pos][: cnt[pos]]
        assert np.all(np.diff(valid) > 0), (pos, valid)
        blocks[pos][valid] = True
    return blocks
