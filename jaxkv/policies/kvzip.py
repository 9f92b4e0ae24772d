"""KVzip: query-agnostic importance from context reconstruction, and global-threshold eviction.

After prefilling a context, the model is asked to repeat it: for each chunk of the context, the
replay input is a repeat prompt ("Repeat the previous context exactly." for the first chunk,
"Repeat the previous context exactly, starting with" + the previous chunk's last 8 tokens for the
others) followed by the chunk itself, placed after the context. A cached KV pair's importance is
the largest attention probability it receives from any replay query of any chunk and any of its
group's query heads, the softmax running over the whole context, the repeat prompt and the chunk
(causally). Each chunk's attention is [queries of one chunk] x [context + chunk]: no T x T matrix.

The replay chunk is 2000 tokens in the paper's code for contexts of 100K+; it scales with the
model's context: 512 by default here (the reference model is trained to 4K, its contexts are
2-4K, so a 2-4K context replays in 4-8 chunks). A shorter context replays in one chunk of its
padded length (prefill pads a prompt to a power of two), so the replay costs about what the
prompt's prefill does, never a 512-token forward pass.

Two choices follow the paper's code (and kvpress's KVzipPress) only when asked, since the
committed results and the gates trained on KVzip's scores were made without them:
`sinks=N` scores each chunk with a softmax over the first N tokens, the chunk's own tokens and
the replay tokens only (the replay's forward still attends to the whole context; the N tokens
are always kept), and `prompt_turn="context"` writes the repeat request into the context's own
user turn ("\n\nRepeat ..." then the template's end of turn and assistant header, a later
chunk's 8 overlap tokens inside the request) instead of a user turn of its own. With
`chunk=2048` they make kvpress's KVzip scoring the whole context (its `kvzip_scored_prefix`).

`KVzip(ratio)` (the oracle Fast KVzip's gates imitate) keeps the best `ratio` of all KV pairs of
a sequence with one threshold over layers x heads x tokens: head budgets come out non-uniform
and `compact` frees the pages of the heads that keep little. `KVzip(ratio, recent=R)` first keeps
every head's newest R prompt positions, inside the same ratio: the shape of WG-KV's cache (a
local ring plus the tokens admitted past it) with KVzip's scores choosing the admitted ones.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import attention as attention_ops
from jaxkv import collectives
from jaxkv.attention.dense import attention_from_scores, grouped_scores, merge_partials
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, rank_descending
from jaxkv.models import layers
from jaxkv.models.chat import render_chat
from jaxkv.models.decoder import (
    attention_input,
    attention_output_and_mlp,
    embed,
    project_keys_values,
    project_queries,
    scan_layers,
)
from jaxkv.policies.base import (
    Budget,
    Policy,
    PromptCompressionPart,
    keep_short_prompts_whole,
    register,
    within_budget,
)
from jaxkv.step.parts import PrefillObservations

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the previous context exactly, starting with"
# The paper's code's (and kvpress's) later-chunk request, with `prompt_turn="context"`.
PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PLAIN_SUFFIX = "\n"  # kvpress's turn end for a model without a chat template
# Where the repeat request goes: a user turn of its own, or the context's own turn.
PROMPT_TURNS = ("own", "context")
OVERLAP = 8
DEFAULT_REPLAY_CHUNK = 512
# Prefix slots a replay layer reads at once (`replay_attention`): a chunk's scores are
# [chunk queries x this], not [chunk queries x the whole context].
REPLAY_PREFIX_BLOCK = 4096


def byte_ids(text: str) -> tuple[int, ...]:
    """Token ids of `text` for the project's byte-level models (the reference model)."""
    return tuple(text.encode())


# The byte-level defaults are ids < 256; a vocabulary this large is not byte-level.
_BYTE_LEVEL_VOCAB_LIMIT = 512
_CONTEXT_MARK = "\u2063KVZIP-CONTEXT\u2063"


def text_after_context(tokenizer, turns: list[dict]) -> str:
    """The chat text that follows a context sent as a user message: the end of that turn, the
    messages `turns` and the assistant's header (rendered by the model's own template)."""
    context = [{"role": "user", "content": _CONTEXT_MARK}]
    text = render_chat(tokenizer, [*context, *turns])
    return text[text.index(_CONTEXT_MARK) + len(_CONTEXT_MARK) :]


def context_prefix_ids(tokenizer) -> tuple[int, ...]:
    """The ids before a context that `repeat_prompt_ids`' prompts follow: a chat model's
    template up to a user message's content (the template writes any bos itself), else the
    tokenizer's bos rule alone."""
    if tokenizer.chat_template is None:
        return tuple(tokenizer.encode(""))
    text = render_chat(tokenizer, [{"role": "user", "content": _CONTEXT_MARK}])
    return tuple(tokenizer.encode(text[: text.index(_CONTEXT_MARK)], add_bos=False))


def repeat_prompt_ids(tokenizer) -> dict[str, tuple[int, ...]]:
    """KVzip's repeat prompts in a model's own ids: {"repeat_ids", "continue_ids"}.

    With a chat template (instruction-tuned models), the request is a user turn after the
    context and the replayed chunk is the assistant's answer, as in the paper's code; without
    one, the plain-text prompts follow the context directly.
    """
    if tokenizer.chat_template is None:
        texts = (REPEAT_PROMPT, CONTINUE_PROMPT)
    else:
        texts = tuple(
            text_after_context(tokenizer, [{"role": "user", "content": p.strip()}])
            for p in (REPEAT_PROMPT, CONTINUE_PROMPT)
        )
    repeat, continue_ = (tuple(tokenizer.encode(text, add_bos=False)) for text in texts)
    return {"repeat_ids": repeat, "continue_ids": continue_}


def in_context_prompt_ids(tokenizer) -> dict[str, tuple[int, ...]]:
    """KVzip's repeat prompts written into the context's own user turn, as the paper's code and
    kvpress write them (KVgrad's too): {"repeat_ids", "continue_ids", "suffix_ids"}; the
    suffix is the chat template's text after a user message's content (the turn end and the
    assistant's header), or "\\n" without a template; each text encoded alone
    (`replay_inputs` joins them)."""
    if tokenizer.chat_template is None:
        suffix = PLAIN_SUFFIX
    else:
        suffix = text_after_context(tokenizer, [])
    request, continue_, suffix_ids = (
        tuple(tokenizer.encode(text, add_bos=False))
        for text in (REPEAT_PROMPT, PART_PROMPT, suffix)
    )
    return {"repeat_ids": request + suffix_ids, "continue_ids": continue_, "suffix_ids": suffix_ids}


def replay_inputs(
    tokens, lengths, index: jax.Array, chunk: int, repeat_ids, continue_ids, suffix_ids=()
):
    """Token ids and positions [B, P + chunk] of replay chunk `index` (P = the longer prompt).

    The first chunk's prompt is `repeat_ids`; a later one's is `continue_ids`, the previous
    chunk's last `OVERLAP` tokens and `suffix_ids` (none in KVzip's code; kvpress closes the
    request with the chat template's turn end). The first chunk's prompt is left-padded
    (position -1) to the length of the later ones'. Rows whose context ends before the chunk get
    only padding.
    """
    b = tokens.shape[0]
    first = jnp.asarray(repeat_ids, jnp.int32)
    start = index * chunk
    overlap = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(start - OVERLAP, 0), OVERLAP, 1)
    later = jnp.concatenate(
        [
            jnp.broadcast_to(jnp.asarray(continue_ids, jnp.int32), (b, len(continue_ids))),
            overlap,
            jnp.broadcast_to(jnp.asarray(suffix_ids, jnp.int32), (b, len(suffix_ids))),
        ],
        axis=1,
    )
    width = later.shape[1]
    if len(repeat_ids) > width:
        raise ValueError(
            f"the repeat prompt ({len(repeat_ids)} tokens) must not be longer than the continue "
            f"prompt plus {OVERLAP} tokens plus the suffix ({width})"
        )
    padded_first = jnp.concatenate([jnp.zeros((width - len(repeat_ids),), jnp.int32), first])
    prompt = jnp.where(index == 0, jnp.broadcast_to(padded_first, (b, width)), later)
    prompt_valid = (jnp.arange(width) >= width - len(repeat_ids)) | (index > 0)
    chunk_ids = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, 1)
    chunk_valid = start + jnp.arange(chunk) < lengths[:, None]
    ids = jnp.concatenate([prompt, chunk_ids], axis=1)
    valid = jnp.concatenate([jnp.broadcast_to(prompt_valid, (b, width)), chunk_valid], 1)
    valid = valid & jnp.any(chunk_valid, axis=1, keepdims=True)
    positions = lengths[:, None] + jnp.cumsum(valid, axis=1) - 1
    return ids, jnp.where(valid, positions, -1)


def largest_received(probs: jax.Array, query_valid: jax.Array) -> jax.Array:
    """KVzip's importance: f32 [B, K, S] the largest probability each slot receives from any
    query of its group (probs [B, K, G, C, S], 0 for invalid queries)."""
    del query_valid
    return jnp.max(probs, axis=(2, 3))


def _prefix_blocks(q, positions, prefix_k, prefix_v, prefix_held, sm_scale):
    """The cached prefix in blocks of `REPLAY_PREFIX_BLOCK` slots: (number of blocks, a function
    of a block index giving its scaled, masked scores [B, K, G, C, block] and values)."""
    s = prefix_k.shape[2]
    block = min(s, REPLAY_PREFIX_BLOCK)
    blocks = -(-s // block)
    pad_slots = ((0, 0), (0, 0), (0, blocks * block - s))
    prefix_k, prefix_v = (jnp.pad(x, (*pad_slots, (0, 0))) for x in (prefix_k, prefix_v))
    prefix_held = jnp.pad(prefix_held, pad_slots)
    query_valid = (positions >= 0)[:, None, None, :, None]

    def prefix_block(index):
        keys, values = (
            jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=2)
            for x in (prefix_k, prefix_v)
        )
        held = jax.lax.dynamic_slice_in_dim(prefix_held, index * block, block, axis=2)
        scores = grouped_scores(q, keys) * sm_scale
        return jnp.where(held[:, :, None, None, :] & query_valid, scores, -jnp.inf), values

    return blocks, prefix_block


def replay_output(q, k, v, positions, prefix_k, prefix_v, prefix_held, sm_scale):
    """Attention of the replay queries q [B, N, C, H] over the cached prefix (keys, values
    [B, K, S, H], slots held bool [B, K, S]) and, causally, the chunk itself (k, v [B, K, C, H]):
    an online softmax over the prefix's blocks, no [C, S] matrix. Returns attn f32 [B, N, C, H]
    and the logsumexp f32 [B, N, C]."""
    query_valid = (positions >= 0)[:, None, None, :, None]
    causal = (positions[:, None, :] <= positions[:, :, None]) & (positions[:, None, :] >= 0)
    chunk_scores = grouped_scores(q, k) * sm_scale
    chunk_scores = jnp.where(causal[:, None, None] & query_valid, chunk_scores, -jnp.inf)
    blocks, prefix_block = _prefix_blocks(q, positions, prefix_k, prefix_v, prefix_held, sm_scale)

    def accumulate(index, partial):
        return merge_partials(*partial, *attention_from_scores(*prefix_block(index)))

    return jax.lax.fori_loop(0, blocks, accumulate, attention_from_scores(chunk_scores, v))


def replay_attention(
    q,
    k,
    v,
    positions,
    prefix_k,
    prefix_v,
    prefix_held,
    sm_scale,
    received=largest_received,
    scored=None,
):
    """`replay_output`, and what each prefix slot received: the prefix read a second time,
    each block's probabilities [B, K, G, C, block] (0 for invalid queries) reduced by
    `received(probs, query_valid)` to [B, K, block]. Returns attn f32 [B, N, C, H] and f32
    [B, K, S] (by default the largest probability from any valid query of its group).

    scored: bool [B, K, S] or None: the prefix slots the probabilities' softmax runs over
    (with the replay tokens); the others receive 0. None: every held slot. The attention
    output reads every held slot either way.
    """
    b, n, c, _ = q.shape
    num_kv, s = prefix_k.shape[1], prefix_k.shape[2]
    out, lse = replay_output(q, k, v, positions, prefix_k, prefix_v, prefix_held, sm_scale)
    if scored is not None:
        prefix_held = prefix_held & scored
        _, lse = replay_output(q, k, v, positions, prefix_k, prefix_v, prefix_held, sm_scale)
    grouped_lse = lse.reshape(b, num_kv, n // num_kv, c)[..., None]
    query_valid = (positions >= 0)[:, None, None, :, None]
    blocks, prefix_block = _prefix_blocks(q, positions, prefix_k, prefix_v, prefix_held, sm_scale)

    def block_received(index):
        scores, _ = prefix_block(index)
        probs = jnp.where(jnp.isfinite(grouped_lse), jnp.exp(scores - grouped_lse), 0.0)
        return received(probs, query_valid)  # [B, K, block]

    per_block = jax.lax.map(block_received, jnp.arange(blocks))  # [blocks, B, K, block]
    return out, jnp.moveaxis(per_block, 0, 2).reshape(b, num_kv, -1)[..., :s]


def _replay_layer(
    lp, cfg, x, cos, sin, positions, prefix_k, prefix_v, prefix_held, received, scored
):
    """One layer on the replay tokens over the cached prefix and themselves.

    Returns the next residual stream and f32 [B, K, S] what each prefix slot received from the
    replay queries (`replay_attention`, `scored` its slots scored or None).
    """
    h = attention_input(lp, cfg, x)
    q = project_queries(lp, cfg, h, cos, sin)
    k, v = project_keys_values(lp, cfg, h, cos, sin)
    sm_scale = cfg.head_dim**-0.5
    attn, slot_scores = replay_attention(
        q, k, v, positions, prefix_k, prefix_v, prefix_held, sm_scale, received, scored
    )
    return attention_output_and_mlp(lp, cfg, x, attn, collectives.reduce_partial_sums), slot_scores


def replay_scores(
    model, kv: KVState, ids, positions, received=largest_received, window=None
) -> jax.Array:
    """f32 [L, B, K, S]: one replay pass of ids int32 [B, C] at positions int32 [B, C] (-1:
    padding) through every layer, over what `kv` holds and causally over themselves; what each
    cached slot received from the replay queries (`replay_attention`'s `received`).

    window: None (the probabilities' softmax over every cached slot) or (start, stop, sinks):
    over the cached tokens at positions [start, stop) and below `sinks` only (the paper's
    code's chunk scoring; `KVzip.sinks`)."""
    cfg, params = model.config, model.params
    cos, sin = layers.rope_cos_sin(cfg, jnp.maximum(positions, 0))
    slots = jnp.arange(kv.max_tokens_per_head)

    def layer(x, lp, xs):
        page_table, layer_lengths, slot_positions = xs
        prefix_k = attention_ops.gather_pages(kv.pool.k_pages, page_table)
        prefix_v = attention_ops.gather_pages(kv.pool.v_pages, page_table)
        held = slots < layer_lengths[..., None]
        scored = None if window is None else in_window(slot_positions, *window)
        return _replay_layer(
            lp, cfg, x, cos, sin, positions, prefix_k, prefix_v, held, received, scored
        )

    xs = (kv.page_table, kv.lengths, kv.positions())
    _, slot_scores = scan_layers(layer, embed(params, ids), params["layers"], xs)
    return slot_scores


def in_window(token_positions, start, stop, sinks) -> jax.Array:
    """bool like token_positions: the tokens at positions [start, stop) or below `sinks`."""
    held = token_positions >= 0
    return held & (
        (token_positions < sinks) | ((token_positions >= start) & (token_positions < stop))
    )


def reconstruction_scores(
    model,
    kv: KVState,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    chunk: int = DEFAULT_REPLAY_CHUNK,
    repeat_ids: tuple[int, ...] = byte_ids(REPEAT_PROMPT),
    continue_ids: tuple[int, ...] = byte_ids(CONTINUE_PROMPT),
    suffix_ids: tuple[int, ...] = (),
    sinks: int | None = None,
) -> jax.Array:
    """f32 [L, B, K, S]: KVzip's importance of every cached slot (0 for empty slots).

    kv: the state after prefilling the contexts (any policy; the replay reads what it holds);
    tokens: int32 [B, T_pad] the right-padded contexts, T_pad a multiple of `chunk`;
    lengths: int32 [B]; suffix_ids: `replay_inputs`'; sinks: None (each chunk's softmax over
    the whole context) or N (over the first N tokens and the chunk's own: `KVzip.sinks`).
    """
    cfg = model.config
    if tokens.shape[1] % chunk:
        raise ValueError(f"tokens have {tokens.shape[1]} columns, not a multiple of chunk={chunk}")
    check_replay_ids(cfg.vocab_size, repeat_ids, continue_ids)

    def one_chunk(best, index):
        ids, positions = replay_inputs(
            tokens, lengths, index, chunk, repeat_ids, continue_ids, suffix_ids
        )
        window = None if sinks is None else (index * chunk, (index + 1) * chunk, sinks)
        scores = replay_scores(model, kv, ids, positions, window=window)
        return jnp.maximum(best, scores), None

    best = jnp.zeros(kv.lengths.shape + (kv.max_tokens_per_head,), jnp.float32)
    best = collectives.varying_like(best, kv.lengths)
    best, _ = jax.lax.scan(one_chunk, best, jnp.arange(tokens.shape[1] // chunk))
    return best


def keep_top_globally(scores, total, held, protected) -> jax.Array:
    """bool [L, B, K, S]: per sequence, the protected slots plus the best-scored others, `total`
    slots in all, ranked with one threshold over layers x heads x slots.

    scores f32 [L, B, K, S]; total int [B] (>= the protected count); held, protected bool.
    """
    ranked = jnp.where(protected, jnp.inf, jnp.where(held, scores, -jnp.inf))
    per_sequence = jnp.moveaxis(ranked, 1, 0)  # [B, L, K, S]
    b = per_sequence.shape[0]
    rank = rank_descending(per_sequence.reshape(b, -1)).reshape(per_sequence.shape)
    keep = rank < total[:, None, None, None]
    return jnp.moveaxis(keep, 0, 1) & held


@dataclasses.dataclass(frozen=True)
class ReplayCompression(PromptCompressionPart):
    """KVzip's prompt compression part: the prompt replayed after a repeat prompt scores every
    cached token by the attention its reconstruction pays it (`reconstruction_scores`), and
    each sequence keeps its best budget x layers x heads over all of them (one threshold).

    Attributes: as `KVzip`'s.
    """

    chunk: int
    repeat_ids: tuple[int, ...]
    continue_ids: tuple[int, ...]
    recent: int = 0
    suffix_ids: tuple[int, ...] = ()
    sinks: int | None = None

    needs_prompt_tokens: ClassVar[bool] = True

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        tokens, chunk = replay_chunks(obs.prompt_tokens, self.chunk)
        scores = reconstruction_scores(
            model,
            kv,
            tokens,
            obs.prompt_lengths,
            chunk=chunk,
            repeat_ids=self.repeat_ids,
            continue_ids=self.continue_ids,
            suffix_ids=self.suffix_ids,
            sinks=self.sinks,
        )
        positions = kv.positions()
        protected = positions >= obs.prompt_lengths[:, None, None] - self.recent
        if self.sinks is not None:
            protected |= (positions >= 0) & (positions < self.sinks)
        total = obs.budget_tokens * kv.num_layers * kv.lengths.shape[2] * collectives.head_shards()
        return compact_top_globally(kv, scores, total, protected)


def replay_chunks(tokens: jax.Array, chunk: int) -> tuple[jax.Array, int]:
    """The prompts int32 [B, T] padded to a multiple of the replay chunk, and the chunk: a
    prompt shorter than `chunk` replays in one chunk of its padded length."""
    chunk = min(chunk, tokens.shape[1])
    return jnp.pad(tokens, ((0, 0), (0, -tokens.shape[1] % chunk))), chunk


def compact_top_globally(kv: KVState, scores, total, protected) -> KVState:
    """`kv` holding, per sequence, its protected slots and best-scored others, `total` in all
    over every device's heads (`keep_top_globally`); scores f32 [L, B, K, S], total int [B],
    protected bool [L, B, K, S]."""
    held = kv.positions() >= 0
    keep = collectives.over_all_heads(
        lambda scores, held, protected: keep_top_globally(scores, total, held, protected),
        scores,
        held,
        protected & held,
        axis=2,
    )
    return compact(kv, keep)


def check_replay_ids(vocab_size: int, *ids: tuple[int, ...]) -> None:
    """Refuses replay prompt ids outside the model's vocabulary."""
    if max(max(group, default=0) for group in ids) >= vocab_size:
        raise ValueError(
            f"the replay prompts' ids (repeat_ids, continue_ids, ...) hold ids outside the "
            f"vocabulary [0, {vocab_size}): pass the model tokenizer's ids "
            "(policy.for_tokenizer(tokenizer))"
        )


@dataclasses.dataclass(frozen=True)
class RatioBudget:
    """KVzip's budget part: floor(share * T) tokens a head on average, or the whole prompt where
    that is fewer than `recent` (a prompt too short to compress around its window is kept
    whole). None in the copy jit sees.

    Attributes:
      owner: the policy's name, for errors.
      share: the ratio kept, in (0, 1].
      recent: the newest positions every head keeps.
    """

    owner: str
    share: float | None
    recent: int = 0

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        if self.share is None:
            raise ValueError(f"policy {self.owner!r} needs ratio= in (0, 1]")
        tokens = Budget(ratio=self.share).tokens_for(prompt_lengths)
        return keep_short_prompts_whole(tokens, prompt_lengths, self.recent)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths):
        return within_budget(budget_tokens, prompt_lengths)


@register
@dataclasses.dataclass(frozen=True)
class KVzip(Policy):
    """KVzip's reconstruction scores, one global threshold: keeps `ratio` of all KV pairs (the
    record of a `ReplayCompression` with its budget).

    Attributes:
      ratio: share of each sequence's KV pairs (over layers x heads x tokens) kept, in (0, 1].
        Stripped (None) in the copy jit sees; it travels as `budget_tokens`.
      chunk: replay chunk in tokens (module docstring).
      repeat_ids, continue_ids: the repeat prompts' token ids (byte-level by default: pass the
        tokenizer's ids of REPEAT_PROMPT / CONTINUE_PROMPT for other models).
      recent: every head's newest `recent` prompt positions are kept whatever their score,
        inside the ratio (0: none, the paper's); a prompt whose ratio keeps fewer is kept whole.
      sinks: None (each replay chunk's softmax over the whole context) or N >= 0: over the
        first N tokens, the chunk's own and the replay tokens, the N kept whatever their
        score, inside the ratio (kvpress's 4; module docstring).
      prompt_turn: "own" (the repeat request a user turn of its own) or "context" (written
        into the context's turn, the paper's code's): which ids `for_tokenizer` gives.
      suffix_ids: ids after a later chunk's overlap (`replay_inputs`; `for_tokenizer` sets
        them for prompt_turn="context").
    """

    name: ClassVar[str] = "kvzip"
    decides_across_heads: ClassVar[bool] = True
    request_knobs: ClassVar[tuple[str, ...]] = ("ratio",)

    ratio: float | None = None
    chunk: int = DEFAULT_REPLAY_CHUNK
    repeat_ids: tuple[int, ...] = byte_ids(REPEAT_PROMPT)
    continue_ids: tuple[int, ...] = byte_ids(CONTINUE_PROMPT)
    recent: int = 0
    sinks: int | None = None
    prompt_turn: str = "own"
    suffix_ids: tuple[int, ...] = ()

    def _check(self) -> None:
        super()._check()
        if self.ratio is not None:
            Budget(ratio=self.ratio)  # validates (0, 1]
        if self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} must be >= 1")
        counts = {"recent": self.recent}
        if self.sinks is not None:
            counts["sinks"] = self.sinks
        for field, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"{field}={value!r} must be an integer >= 0")
        if self.prompt_turn not in PROMPT_TURNS:
            raise ValueError(f"prompt_turn={self.prompt_turn!r} must be one of {PROMPT_TURNS}")
        later = len(self.continue_ids) + OVERLAP + len(self.suffix_ids)
        if not self.repeat_ids or len(self.repeat_ids) > later:
            raise ValueError(
                "repeat_ids must be non-empty and at most len(continue_ids) + 8 + "
                "len(suffix_ids) tokens long"
            )

    def _parts(self) -> dict:
        return {
            "prompt_compression": ReplayCompression(
                self.chunk,
                self.repeat_ids,
                self.continue_ids,
                self.recent,
                self.suffix_ids,
                self.sinks,
            ),
            # the protected tokens need room: a prompt whose ratio keeps fewer is kept whole
            "budget_rule": RatioBudget(self.name, self.ratio, self.recent + (self.sinks or 0)),
        }

    def for_tokenizer(self, tokenizer) -> KVzip:
        if self.prompt_turn == "context":
            return dataclasses.replace(self, **in_context_prompt_ids(tokenizer))
        return dataclasses.replace(self, **repeat_prompt_ids(tokenizer), suffix_ids=())

    def check_model(self, model_config) -> None:
        defaults = (byte_ids(REPEAT_PROMPT), byte_ids(CONTINUE_PROMPT))
        byte_level = (self.repeat_ids, self.continue_ids) == defaults
        check_byte_level_prompts(self.name, byte_level, model_config)


def check_byte_level_prompts(owner: str, byte_level: bool, model_config) -> None:
    """Refuses a replay policy's byte-level default prompts for a model whose vocabulary is
    not byte-level (its ids would be other tokens)."""
    if byte_level and model_config.vocab_size > _BYTE_LEVEL_VOCAB_LIMIT:
        raise ValueError(
            f"policy {owner!r} would replay its byte-level repeat prompt to a model with "
            f"{model_config.vocab_size} tokens: give the model's ids with "
            "policy.for_tokenizer(tokenizer) (or repeat_ids=/continue_ids=)"
        )
