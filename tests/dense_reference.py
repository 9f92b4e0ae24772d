"""A decode step computed densely in numpy, head by head, over explicitly given cached keys."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.decoder import (
    attention_inputs,
    attention_output_and_mlp,
    embed,
    final_hidden,
    logits_from_hidden,
)
from jaxkv.models.layers import rope_cos_sin


def cached_keys_values(state):
    """Per layer, per sequence, per KV head: the held keys and values [n, H] in cache order."""
    from jaxkv.attention import gather_pages

    keys, values = [], []
    for layer in range(state.num_layers):
        k = np.asarray(gather_pages(state.pool.k_pages, state.page_table[layer]))
        v = np.asarray(gather_pages(state.pool.v_pages, state.page_table[layer]))
        n = np.asarray(state.lengths[layer])
        keys.append([[k[b, h, : n[b, h]] for h in range(n.shape[1])] for b in range(n.shape[0])])
        values.append([[v[b, h, : n[b, h]] for h in range(n.shape[1])] for b in range(n.shape[0])])
    return keys, values


def decode_step_logits(model, token, position, keys, values, select=None):
    """Logits [B, V] of one decode step where each head attends to the given keys/values (or the
    subset `select(layer, b, kv_head, q_group [G, H], keys) -> index array` picks) plus itself.
    """
    cfg, params = model.config, model.params
    positions = jnp.asarray(position)[:, None]
    cos, sin = rope_cos_sin(cfg, positions)
    x = embed(params, jnp.asarray(token)[:, None])
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
        q, k, v = (np.asarray(a) for a in attention_inputs(lp, cfg, x, cos, sin))
        out = np.zeros(q.shape, np.float64)
        g = cfg.group_size
        for b in range(q.shape[0]):
            for kv_head in range(cfg.num_kv_heads):
                cached_k, cached_v = keys[layer][b][kv_head], values[layer][b][kv_head]
                if select is not None:
                    chosen = select(
                        layer, b, kv_head, q[b, kv_head * g : (kv_head + 1) * g, 0], cached_k
                    )
                    cached_k, cached_v = cached_k[chosen], cached_v[chosen]
                all_k = np.concatenate([cached_k, k[b, kv_head]], axis=0)
                all_v = np.concatenate([cached_v, v[b, kv_head]], axis=0)
                for n in range(kv_head * g, (kv_head + 1) * g):
                    s = all_k @ q[b, n, 0] / np.sqrt(cfg.head_dim)
                    p = np.exp(s - s.max())
                    out[b, n, 0] = (p / p.sum()) @ all_v
        x = attention_output_and_mlp(lp, cfg, x, jnp.asarray(out, jnp.float32))
    return np.asarray(logits_from_hidden(params, cfg, final_hidden(params, cfg, x)))[:, 0]
