"""Queries of calibration text, for the policies whose parameters summarise a model's queries
ahead of any prompt (Q-Filters' directions, ExpectedAttention's statistics)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv.models import layers
from jaxkv.models.decoder import (
    attention_input,
    attention_output_and_mlp,
    embed,
    project_keys_values,
    project_unrotated_queries,
    scan_layers,
)


@partial(jax.jit, static_argnames=("rotated",))
def layer_queries(model, tokens, *, rotated: bool) -> jax.Array:
    """Every layer's queries [L, B, N, T, H] under full causal attention over tokens int32
    [B, T] (no padding): after RoPE when `rotated`, else before it (after Qwen3's q_norm)."""
    cfg, params = model.config, model.params
    t = tokens.shape[1]
    cos, sin = layers.rope_cos_sin(cfg, jnp.broadcast_to(jnp.arange(t), tokens.shape))
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]

    def layer(x, lp, _):
        h = attention_input(lp, cfg, x)
        unrotated = project_unrotated_queries(lp, cfg, h)
        q = layers.apply_rope(unrotated, cos, sin)
        k, v = project_keys_values(lp, cfg, h, cos, sin)
        probs = attention_ops.attention_probabilities(q, k, causal, cfg.head_dim**-0.5)
        attn = jnp.einsum("bnts,bnsh->bnth", probs, jnp.repeat(v, cfg.group_size, axis=1))
        return attention_output_and_mlp(lp, cfg, x, attn), q if rotated else unrotated

    _, queries = scan_layers(layer, embed(params, tokens), params["layers"])
    return queries
