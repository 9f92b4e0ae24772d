"""The model's forward passes over jaxkv's attention and paged KV cache.

`forward` is the model's cache-free forward with the attention on a chosen backend.
`forward_cached` runs one chunk (prefill chunk or decode token) through the model's blocks
(`jaxkv.models.decoder`), threading the paged KV state layer by layer: per layer, the model projects
q, k, v, the policy's gate scores the chunk's keys (`write_scores`), `layer_step.attend_and_write`
attends and writes, and the model's output projection and MLP follow.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv import collectives
from jaxkv.cache import KVState, LocalRing
from jaxkv.models import decoder, layers
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model
from jaxkv.step.layer import attend_and_write
from jaxkv.step.parts import PolicyParts, local_window


def forward(
    model: Model,
    tokens: jax.Array,
    *,
    backend: str | attention_ops.Backend = "xla",
    remat: bool = False,
) -> jax.Array:
    """Causal forward over whole sequences without a cache: logits [B, T, V] (f32), the
    attention on `backend` ("xla", "pallas" or "interpret"; `jaxkv.attention`).

    remat: recompute each layer's activations in the backward pass instead of storing them
    (training at long context).
    """
    backend = attention_ops.resolve_backend(backend)
    attention_fn = functools.partial(attention_ops.causal_attention, backend=backend)
    return decoder.forward(model, tokens, attention_fn=attention_fn, remat=remat)


def _check_chunk_shapes(
    cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, kv: KVState
) -> None:
    """Static shape checks, raised while tracing (before compilation)."""
    if tokens.ndim != 2 or tokens.shape != positions.shape:
        raise ValueError(
            f"tokens {tokens.shape} and positions {positions.shape} must both be [B, C]"
        )
    expected = (cfg.num_layers, tokens.shape[0], cfg.num_kv_heads)
    if kv.page_table.shape[:3] != expected:
        raise ValueError(
            f"kv state is for [L, B, K] = {kv.page_table.shape[:3]}, "
            f"the model and tokens need {expected}"
        )
    if kv.pool.k_pages.shape[-1] != cfg.head_dim:
        raise ValueError(
            f"kv pages have head dim {kv.pool.k_pages.shape[-1]}, the model {cfg.head_dim}"
        )


def forward_cached(
    model: Model,
    tokens: jax.Array,
    positions: jax.Array,
    kv: KVState,
    *,
    policy: PolicyParts,
    backend: str | attention_ops.Backend = "xla",
    collect_queries: bool = False,
    collect_input_stats: bool = False,
    collect_query_moments_from: int | None = None,
    read_budget: jax.Array | None = None,
    policy_params: Any = None,
    thresholds: jax.Array | None = None,
) -> tuple[jax.Array, KVState, dict[str, jax.Array]]:
    """One chunk (prefill chunk or decode step) through the paged KV state.

    Args:
      tokens: int32 [B, C]; positions: int32 [B, C] original positions, -1 marks padding
        (not attended from, never written).
      kv: the KV state holding everything before this chunk.
      policy: the cache policy (static; `jaxkv.step.parts`): its gate scores and its admission
        decides what is written, its attention scoring and selection act in the step.
      backend: "xla", "pallas" or "interpret", resolved here once (`jaxkv.attention.Backend`).
      collect_queries: also return every layer's rotated queries, "queries" [L, B, N, C, H].
      collect_input_stats: also return per-layer statistics of the attention input over the
        chunk's valid tokens: "input_mean" and "input_m2" (sum of squared deviations from that
        mean, two-pass) f32 [L, B, D], to be combined across chunks (`combine_moments`).
      collect_query_moments_from: also return each query head's moments over the chunk's tokens
        at positions >= this one, before RoPE: "query_mean" f32 [L, B, N, H] and "query_m2"
        [L, B, N, H, H] (the sum of deviations' outer products, `combine_covariances`).
      read_budget: int32 [B] tokens' worth of pages a page-selecting policy reads (Quest).
      policy_params: the policy's learned parameters (gates), every leaf stacked [L, ...];
        layer l's slice reaches the gate's `write_scores`. None for policies without them.
      thresholds: f32 [B, n] the policy's thresholds (`Policy.thresholds`: WG-KV's tau), read
        by its admission; None for a policy without any.
    Returns:
      final-normed hidden states [B, C, D], the KV state with the chunk written, and the
      collected per-layer values (an empty dict when nothing is collected).
    """
    cfg, params = model.config, model.params
    backend = attention_ops.resolve_backend(backend)
    _check_chunk_shapes(cfg, tokens, positions, kv)
    _check_ring(policy, kv.ring)
    cos, sin = decoder.rope_for(cfg, positions)
    valid = (positions >= 0)[..., None]

    def layer(carry, lp, xs):
        x, pool = carry
        page_table, lengths, layer_index, layer_policy_params, ring = xs
        h = decoder.attention_input(lp, cfg, x)
        q_unrotated = decoder.project_unrotated_queries(lp, cfg, h)
        q = layers.apply_rope(q_unrotated, cos, sin)
        k_unrotated, v = decoder.project_unrotated_keys_values(lp, cfg, h)
        k = layers.apply_rope(k_unrotated, cos, sin)
        write_scores = None
        if policy.gate is not None:
            write_scores = policy.gate.write_scores(
                layer_policy_params,
                h=h,
                q=q,
                k_unrotated=k_unrotated,
                k=k,
                v=v,
                positions=positions,
            )
        attn, pool, page_table, lengths, ring = attend_and_write(
            pool,
            page_table,
            lengths,
            q,
            k,
            v,
            positions,
            layer=layer_index,
            sm_scale=cfg.head_dim**-0.5,
            policy=policy,
            backend=backend,
            read_budget=read_budget,
            write_scores=write_scores,
            thresholds=thresholds,
            ring=ring,
        )
        collected = {}
        if collect_queries:
            collected["queries"] = q
        if collect_input_stats:
            collected["input_mean"], collected["input_m2"] = chunk_moments(h, valid)
        if collect_query_moments_from is not None:
            counted = (positions >= collect_query_moments_from)[:, None, :, None]
            collected["query_mean"], collected["query_m2"] = chunk_covariance(q_unrotated, counted)
        x = decoder.attention_output_and_mlp(lp, cfg, x, attn, collectives.reduce_partial_sums)
        return (x, pool), (page_table, lengths, ring, collected)

    layer_indices = jnp.arange(cfg.num_layers)
    xs = (kv.page_table, kv.lengths, layer_indices, policy_params, kv.ring)
    (x, pool), (page_table, lengths, ring, collected) = decoder.scan_layers(
        layer, (decoder.embed(params, tokens), kv.pool), params["layers"], xs
    )
    kv = dataclasses.replace(kv, pool=pool, page_table=page_table, lengths=lengths, ring=ring)
    return decoder.final_hidden(params, cfg, x), kv, collected


def _check_ring(policy: PolicyParts, ring: LocalRing | None) -> None:
    """Raises when a policy whose admission reads a local ring meets a state without one of
    its size."""
    wanted = local_window(policy)
    if wanted and (ring is None or ring.window != wanted):
        have = "no local ring" if ring is None else f"a local ring of {ring.window} slots"
        raise ValueError(
            f"policy {policy.name!r} needs a KV state with a local ring of window={wanted} "
            f"slots (KVState.create(local_window=...)); this state has {have}"
        )


def chunk_moments(h: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and sum of squared deviations f32 [B, D] of h [B, C, D] over the valid [B, C, 1]
    tokens, in two passes (a large mean does not cancel the variance away)."""
    h32 = h.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(valid, axis=1), 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, h32, 0.0), axis=1) / count
    deviation = jnp.where(valid, h32 - mean[:, None], 0.0)
    return mean, jnp.sum(deviation * deviation, axis=1)


def chunk_covariance(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean f32 [..., H] and sum of the deviations' outer products f32 [..., H, H] of the
    vectors x [..., C, H] over the valid [..., C, 1] ones (two passes, as `chunk_moments`)."""
    x32 = x.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(valid, axis=-2), 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, x32, 0.0), axis=-2) / count
    deviation = jnp.where(valid, x32 - mean[..., None, :], 0.0)
    m2 = jnp.einsum("...ci,...cj->...ij", deviation, deviation, precision="highest")
    return mean, m2


def combine_covariances(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
    """`combine_moments` for vectors: (count, mean [..., H], m2 [..., H, H]) of two disjoint
    sets from each one's; counts broadcast against the means."""
    count = count_a + count_b
    safe = jnp.maximum(count, 1).astype(jnp.float32)
    delta = mean_b - mean_a
    mean = mean_a + delta * (count_b / safe)
    weight = (count_a * count_b / safe)[..., None]
    m2 = m2_a + m2_b + delta[..., :, None] * delta[..., None, :] * weight
    return count, mean, m2


def combine_moments(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
    """Chan et al.'s parallel update: (count, mean, m2) of two disjoint sets of tokens from each
    one's. Counts broadcast against the means (e.g. [B, 1] with [L, B, D])."""
    count = count_a + count_b
    safe = jnp.maximum(count, 1).astype(jnp.float32)
    delta = mean_b - mean_a
    mean = mean_a + delta * (count_b / safe)
    m2 = m2_a + m2_b + delta * delta * (count_a * count_b / safe)
    return count, mean, m2
