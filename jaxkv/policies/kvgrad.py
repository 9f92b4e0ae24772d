"""KVgrad (kvpress's KVgradPress): KVzip's replay, each cached pair scored by input x gradient
attribution of the model's last hidden states.

The prompt is replayed in chunks after itself, as in KVzip (`kvzip.replay_inputs`, kvpress's
prompts: "Repeat the previous context exactly." for the first chunk, "Repeat the part of the
previous context exactly, starting with" + the previous chunk's last 8 tokens for the others,
each closed by the chat template's turn end, or "\\n" without one). For the pair c of layer l in
the chunk being replayed:

    S[l, c] = max over replay tokens p and the KV head's query heads of
              A[p, c] * ||v_c W_O|| * ||d Phi / d a_p||

A is the replay query's attention over the first `sinks` positions, the chunk's pairs and the
replay tokens themselves (causally: kvpress's softmax, not the one over the whole context the
replay's forward pass uses); ||v_c W_O|| what the pair writes into the residual stream through
that query head's output projection; a_p the residual stream after layer l's attention at
replay token p, and Phi = sum over replay tokens of ||h_p||^2, h the last layer's output before
the final norm. The gradient is one `jax.grad` per chunk over per-layer offsets of a_p (zero:
the forward pass is the model's own), the layers rematerialised in the backward pass.

Each sequence keeps L x K x T - floor(L x K x T x (1 - ratio)) pairs (kvpress's count) with one
threshold over layers x heads x positions, the first `sinks` positions always (kvpress's
n_sink). kvpress treats the tokens of a chat template's prefix apart (they are never scored);
here the whole prompt is the context.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv import collectives
from jaxkv.attention.dense import attention_probabilities
from jaxkv.cache import KVState
from jaxkv.models import layers
from jaxkv.models.decoder import (
    attention_input,
    attention_residual,
    embed,
    mlp_residual,
    project_keys_values,
    project_queries,
    scan_layers,
)
from jaxkv.policies import base
from jaxkv.policies.kvzip import (
    OVERLAP,
    PART_PROMPT,
    PLAIN_SUFFIX,
    REPEAT_PROMPT,
    byte_ids,
    check_byte_level_prompts,
    check_replay_ids,
    compact_top_globally,
    in_context_prompt_ids,
    replay_chunks,
    replay_inputs,
    replay_output,
)
from jaxkv.policies.structure import SpreadShareBudget
from jaxkv.step.parts import PrefillObservations

DEFAULT_CHUNK = 512


def _chunk_attribution(q, k, positions, prefix_k, prefix_v, prefix_held, start, chunk, sinks, wo):
    """f32 [B, K, G, C, chunk]: A x ||v W_O|| of the chunk's cached pairs (slots [start, start +
    chunk)) from each replay query (q [B, N, C, H] at positions [B, C], -1 padding; k the replay
    keys [B, K, C, H]; prefix keys, values [B, K, S, H], held [B, K, S]; wo [N, H, D])."""
    b, n, c, _ = q.shape
    num_kv = prefix_k.shape[1]
    group = n // num_kv
    sink_slots = jnp.arange(sinks) < jnp.minimum(sinks, start)
    sink_held = prefix_held[:, :, :sinks] & sink_slots
    chunk_k, chunk_v, chunk_held = (
        jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=2)
        for x in (prefix_k, prefix_v, prefix_held)
    )
    keys = jnp.concatenate([prefix_k[:, :, :sinks], chunk_k, k], axis=2)
    causal = (positions[:, None, :] <= positions[:, :, None]) & (positions[:, None, :] >= 0)
    mask = jnp.concatenate(
        [
            jnp.broadcast_to(sink_held[:, :, None, None, :], (b, num_kv, 1, c, sinks)),
            jnp.broadcast_to(chunk_held[:, :, None, None, :], (b, num_kv, 1, c, chunk)),
            jnp.broadcast_to(causal[:, None, None], (b, num_kv, 1, c, c)),
        ],
        axis=-1,
    )
    probs = attention_probabilities(q, keys, mask, q.shape[-1] ** -0.5)
    probs = probs.reshape(b, num_kv, group, c, -1)[..., sinks : sinks + chunk]
    probs = jnp.where((positions >= 0)[:, None, None, :, None], probs, 0.0)
    per_head_wo = wo.reshape(num_kv, group, *wo.shape[1:]).astype(jnp.float32)
    written = jnp.einsum("bksh,kghd->bkgsd", chunk_v.astype(jnp.float32), per_head_wo)
    return probs * jnp.linalg.norm(written, axis=-1)[:, :, :, None, :]


def _chunk_scores(model, kv: KVState, ids, positions, start, chunk: int, sinks: int) -> jax.Array:
    """f32 [L, B, K, chunk]: KVgrad's scores of the cached pairs in slots [start, start + chunk)
    from one replay pass of ids int32 [B, C] at positions int32 [B, C] (-1: padding)."""
    cfg, params = model.config, model.params
    ids, positions = collectives.alike_over_heads(ids), collectives.alike_over_heads(positions)
    cos, sin = layers.rope_cos_sin(cfg, jnp.maximum(positions, 0))
    slots = jnp.arange(kv.max_tokens_per_head)
    # The last chunk may run past the cache's slots: they are padded (and not held).
    past_the_end = ((0, 0), (0, 0), (0, chunk))

    def layer(x, lp, xs):
        page_table, layer_lengths, offset = xs
        prefix_k, prefix_v = (
            attention_ops.gather_pages(pages, page_table)
            for pages in (kv.pool.k_pages, kv.pool.v_pages)
        )
        held = slots < layer_lengths[..., None]
        h = attention_input(lp, cfg, x)
        q = project_queries(lp, cfg, h, cos, sin)
        k, v = project_keys_values(lp, cfg, h, cos, sin)
        out, _ = replay_output(q, k, v, positions, prefix_k, prefix_v, held, cfg.head_dim**-0.5)
        attribution = _chunk_attribution(
            q,
            k,
            positions,
            *(jnp.pad(y, (*past_the_end, (0, 0))) for y in (prefix_k, prefix_v)),
            jnp.pad(held, past_the_end),
            start,
            chunk,
            sinks,
            lp["wo"],
        )
        x = attention_residual(lp, x, out, collectives.reduce_partial_sums) + offset
        x = mlp_residual(lp, cfg, x, collectives.reduce_partial_sums)
        return x, jax.lax.stop_gradient(attribution)

    def objective(offsets):
        xs = (kv.page_table, kv.lengths, offsets)
        last, attribution = scan_layers(layer, embedded, params["layers"], xs, remat=True)
        squares = jnp.square(last.astype(jnp.float32))
        return jnp.sum(jnp.where((positions >= 0)[..., None], squares, 0.0)), attribution

    embedded = embed(params, ids)
    offsets = jnp.broadcast_to(jnp.zeros_like(embedded), (kv.num_layers, *embedded.shape))
    gradients, attribution = jax.grad(objective, has_aux=True)(offsets)
    sensitivity = jnp.linalg.norm(gradients.astype(jnp.float32), axis=-1)  # [L, B, C]
    weighted = attribution * sensitivity[:, :, None, None, :, None]  # [L, B, K, G, C, chunk]
    return jnp.max(weighted, axis=(3, 4))


def kvgrad_scores(
    model,
    kv: KVState,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    chunk: int,
    sinks: int,
    repeat_ids: tuple[int, ...],
    continue_ids: tuple[int, ...],
    suffix_ids: tuple[int, ...],
) -> jax.Array:
    """f32 [L, B, K, S]: KVgrad's score of every cached slot (0 for empty slots).

    kv: the state after prefilling the prompts whole (slot i holds position i);
    tokens: int32 [B, T_pad] the right-padded prompts, T_pad a multiple of `chunk`;
    lengths: int32 [B].
    """
    if tokens.shape[1] % chunk:
        raise ValueError(f"tokens have {tokens.shape[1]} columns, not a multiple of chunk={chunk}")
    check_replay_ids(model.config.vocab_size, repeat_ids, continue_ids, suffix_ids)
    capacity = kv.max_tokens_per_head

    def one_chunk(scores, index):
        ids, positions = replay_inputs(
            tokens, lengths, index, chunk, repeat_ids, continue_ids, suffix_ids
        )
        chunk_scores = _chunk_scores(model, kv, ids, positions, index * chunk, chunk, sinks)
        return jax.lax.dynamic_update_slice_in_dim(scores, chunk_scores, index * chunk, 3), None

    scores = jnp.zeros(kv.lengths.shape + (capacity + chunk,), jnp.float32)
    scores = collectives.varying_like(scores, kv.lengths)
    scores, _ = jax.lax.scan(one_chunk, scores, jnp.arange(tokens.shape[1] // chunk))
    return scores[..., :capacity]


def kept_pairs(share: float, pairs: jax.Array) -> jax.Array:
    """kvpress's count of the pairs a sequence keeps out of `pairs` (int [B]): all but
    floor(pairs x (1 - share)), in float32."""
    pruned = jnp.floor(pairs.astype(jnp.float32) * jnp.float32(1.0 - share))
    return pairs - pruned.astype(pairs.dtype)


@dataclasses.dataclass(frozen=True)
class GradientReplayCompression(base.PromptCompressionPart):
    """KVgrad's prompt compression part (module docstring). Attributes: as `KVgrad`'s, `share`
    static (each share compiles its own program)."""

    share: float | None  # None only where `SpreadShareBudget.tokens` refuses the policy first
    chunk: int
    sinks: int
    repeat_ids: tuple[int, ...]
    continue_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]

    needs_prompt_tokens: ClassVar[bool] = True

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        tokens, chunk = replay_chunks(obs.prompt_tokens, self.chunk)
        scores = kvgrad_scores(
            model,
            kv,
            tokens,
            obs.prompt_lengths,
            chunk=chunk,
            sinks=self.sinks,
            repeat_ids=self.repeat_ids,
            continue_ids=self.continue_ids,
            suffix_ids=self.suffix_ids,
        )
        heads = kv.num_layers * kv.lengths.shape[2] * collectives.head_shards()
        # The sinks are kept where kvpress's count would evict some of them too.
        total = jnp.maximum(
            kept_pairs(self.share, obs.prompt_lengths * heads),
            jnp.minimum(obs.prompt_lengths, self.sinks) * heads,
        )
        return compact_top_globally(kv, scores, total, kv.positions() < self.sinks)


@base.register
@dataclasses.dataclass(frozen=True)
class KVgrad(base.Policy):
    """KVgradPress: KVzip's replay scored by input x gradient attribution (module docstring).

    Attributes:
      ratio: the share of all KV pairs kept, in (0, 1] (kvpress's 1 - compression_ratio).
      chunk: prompt tokens replayed per pass (kvpress's chunk_size); a shorter prompt replays
        in one chunk of its padded length.
      sinks: the first positions always kept, and attended in the scoring softmax (n_sink).
      repeat_ids, continue_ids, suffix_ids: the replay prompts' ids (byte-level by default;
        `for_tokenizer` gives a model's own).
    """

    name: ClassVar[str] = "kvgrad"
    decides_across_heads: ClassVar[bool] = True

    ratio: float | None = None
    chunk: int = DEFAULT_CHUNK
    sinks: int = 4
    repeat_ids: tuple[int, ...] = byte_ids(REPEAT_PROMPT + PLAIN_SUFFIX)
    continue_ids: tuple[int, ...] = byte_ids(PART_PROMPT)
    suffix_ids: tuple[int, ...] = byte_ids(PLAIN_SUFFIX)

    def _check(self) -> None:
        super()._check()
        if self.ratio is not None:
            base.Budget(ratio=self.ratio)  # validates (0, 1]
        for field, least in (("chunk", 1), ("sinks", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{field}={value!r} must be an integer >= {least}")
        if not self.repeat_ids or len(self.repeat_ids) > (
            len(self.continue_ids) + OVERLAP + len(self.suffix_ids)
        ):
            raise ValueError(
                "repeat_ids must be non-empty and at most len(continue_ids) + 8 + "
                "len(suffix_ids) tokens long"
            )

    def _parts(self) -> dict:
        share = None if self.ratio is None else float(self.ratio)
        compression = GradientReplayCompression(
            share,
            self.chunk,
            self.sinks,
            self.repeat_ids,
            self.continue_ids,
            self.suffix_ids,
        )
        return {
            "prompt_compression": compression,
            "budget_rule": SpreadShareBudget(self.name, share),
        }

    def for_tokenizer(self, tokenizer) -> KVgrad:
        return dataclasses.replace(self, **in_context_prompt_ids(tokenizer))

    def check_model(self, model_config) -> None:
        defaults = KVgrad()
        byte_level = (self.repeat_ids, self.continue_ids, self.suffix_ids) == (
            defaults.repeat_ids,
            defaults.continue_ids,
            defaults.suffix_ids,
        )
        check_byte_level_prompts(self.name, byte_level, model_config)
