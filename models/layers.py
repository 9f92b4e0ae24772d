"""Building blocks shared by the decoder families: RMSNorm, RoPE, SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.models.configs import ModelConfig, RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in f32 and cast back as Hugging Face does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _scaled_inv_freq(inv_freq: jax.Array, scaling: RopeScaling) -> jax.Array:
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [H/2] in f32, with the config's scaling applied."""
    exponents = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is not None:
        inv_freq = _scaled_inv_freq(inv_freq, cfg.rope_scaling)
    return inv_freq


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., H] (f32) for integer `positions` [...], in HF's half-split layout."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, N, T, H] by cos/sin [B, T, H] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None].astype(x.dtype)
    sin = sin[:, None].astype(x.dtype)
    return x * cos + rotated * sin


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); x [B, T, D], w_gate/w_up [D, F], w_down [F, D]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float) -> jax.Array:
    """Plain causal softmax attention in f32 (the model's own, cache-free): q [B, N, T, H],
    k, v [B, K, T, H], query head n reading KV head n // (N // K). Returns [B, N, T, H] in q's
    dtype. Kernel backends live above the model (`jaxkv.attention.causal_attention`)."""
    b, n, t, h = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(b, num_kv_heads, n // num_kv_heads, t, h)
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores * sm_scale, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, v.astype(jnp.float32))
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(b, n, t, h).astype(q.dtype)
