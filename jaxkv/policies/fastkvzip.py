"""Fast KVzip: learned sink-attention gates score every token as it is written; eviction runs
during chunked prefill and every 128 decode steps, with one threshold over layers x heads x tokens.

- Scores: `write_scores` runs the layer's gate (`jaxkv.gates.fastkvzip`) on the attention input
  of every written token; the score is stored with the token (`token_scores`).
- Prefill: after each chunk, each sequence keeps its newest w tokens and its first `sinks` = 4
  (every head; the paper lists the sinks for decode only: keeping them in prefill too means
  a decode eviction never finds them gone) plus the best-gated others, floor(r * seen) tokens per
  head on average over layers x heads (one global threshold, so head budgets are non-uniform),
  where seen is the number of prompt tokens written so far. The budget is the ratio of what has
  been seen, so after the last chunk the total kept is exactly floor(r * T) x L x K (the public
  code's "ratio correction": the protected tokens count inside the budget). The pool array
  itself is sized for the compressed cache plus one chunk (`prefill_pages`), so the prefill
  peak is that, not the full context.
- Window: w = ceil(2% of the prompt) for prompts shorter than 16K tokens (the paper's prefill
  chunk; the reference model's contexts are 2-8K), 4096 from there (the paper's value);
  `window=` overrides it. A prompt whose budget floor(r * T) is smaller than w is kept whole
  (its decode keeps its whole length too: its ratio is 1); the prefill chunk must be >= the w of
  every prompt compressed. Without a `prefill_chunk`, `generate` prefills in the paper's 16K
  chunks once w is 4096, else in its default chunks (`prefill_chunk`).
- Decode: a token's gate score is computed when it is written (the same per-token function the
  paper applies to its 128-token buffer of hidden states). Every `decode_buffer` = 128 generated
  tokens, each sequence evicts globally down to floor(r * current length) per head on average,
  always keeping the first `sinks` = 4 positions and the newest 128.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, evict_in_place
from jaxkv.gates import fastkvzip as gate
from jaxkv.policies.base import (
    Budget,
    LearnedParams,
    Policy,
    keep_short_prompts_whole,
    register,
    within_budget,
)
from jaxkv.policies.kvzip import keep_top_globally
from jaxkv.step.parts import DecodeContext, budget_column

LONG_CONTEXT = 16384
LONG_CONTEXT_WINDOW = 4096
SHORT_CONTEXT_WINDOW_FRACTION = 0.02

# The columns of its budget (`FastKVzip.budget_columns`): tokens kept per head after the prompt,
# the protected window, and a fixed decode budget (0: the ratio of the growing length).
BUDGET_COLUMNS = ("kept", "window", "decode")


def default_window(prompt_length: int) -> int:
    """The protected recent window for a prompt of this length (module docstring)."""
    if prompt_length >= LONG_CONTEXT:
        return LONG_CONTEXT_WINDOW
    return max(1, math.ceil(SHORT_CONTEXT_WINDOW_FRACTION * prompt_length))


def protected_windows(window: int | None, prompt_lengths: np.ndarray) -> np.ndarray:
    """int32 [B] the protected window w of each prompt: `window` (at most the prompt), or
    `default_window` where it is None."""
    if window is not None:
        return np.minimum(window, prompt_lengths).astype(np.int32)
    return np.array([default_window(int(n)) for n in prompt_lengths], np.int32)


def kept_and_windows(
    ratio: float | None, window: int | None, prompt_lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """int32 [B] tokens kept per head and the window w of each prompt: floor(r * T), or the
    whole prompt T where that is fewer than w (a prompt too short to compress around its window
    is kept whole)."""
    if ratio is None:
        raise ValueError("policy 'fastkvzip' needs ratio= in (0, 1]")
    lengths = np.asarray(prompt_lengths)
    windows = protected_windows(window, lengths)
    kept = keep_short_prompts_whole(Budget(ratio=ratio).tokens_for(lengths), lengths, windows)
    return kept, windows


def _scaled_total(final, seen, lengths, heads: int):
    """int32 [B]: floor(final * seen / length) tokens per head, times the heads, in f32 math."""
    share = seen.astype(jnp.float32) / jnp.maximum(lengths, 1).astype(jnp.float32)
    return jnp.floor(final.astype(jnp.float32) * share).astype(jnp.int32) * heads


def _heads(kv: KVState) -> int:
    """(layer, KV head) pairs of a sequence, every device's on a mesh."""
    return kv.num_layers * kv.lengths.shape[2] * collectives.head_shards()


def _evict_globally(kv: KVState, total, protected, max_moves=None) -> KVState:
    """Keeps `total` [B] tokens per sequence over every layer and KV head (all devices' heads
    on a mesh), the protected ones first; in place (`evict_in_place`, up to `max_moves` moves
    per head) during decode."""

    def keep(scores, held, protected):
        protected = protected & held
        forced = jnp.sum(protected, axis=(0, 2, 3), dtype=jnp.int32)
        return keep_top_globally(scores, jnp.maximum(total, forced), held, protected)

    held = kv.positions() >= 0
    keep_mask = collectives.over_all_heads(keep, kv.token_scores(), held, protected, axis=2)
    if max_moves is None:
        return compact(kv, keep_mask)
    return evict_in_place(kv, keep_mask, max_moves)


@dataclasses.dataclass(frozen=True)
class SinkAttentionGate:
    """The gate part: each layer's learned sink-attention gate (`jaxkv.gates.fastkvzip`) scores
    every written token from its attention input."""

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del k_unrotated, k, positions, q, v
        return gate.gate_scores(layer_params, h)


@dataclasses.dataclass(frozen=True)
class ChunkedPrefillEviction:
    """The chunk eviction part: after each prefill chunk, each sequence keeps floor(r * seen)
    tokens per head on average over layers x heads (one global threshold), its first `sinks`
    and newest w tokens protected; the pool holds the kept tokens plus one chunk.

    Attributes:
      ratio: r (None in the copy jit sees: it travels in `budget_tokens`).
      window: the protected window w (None: `default_window` of each prompt).
      sinks: first positions always kept.
    """

    ratio: float | None
    window: int | None
    sinks: int

    def prefill_chunk(self, prompt_lengths: np.ndarray, default: int) -> int:
        """The paper's 16K chunks at long context (four protected windows of 4K); at shorter
        context `default`, or the widest window if that is larger."""
        widest = int(protected_windows(self.window, np.asarray(prompt_lengths)).max())
        if widest >= LONG_CONTEXT_WINDOW:
            return LONG_CONTEXT
        return max(default, widest)

    def prefill_pages(self, prompt_lengths, chunk, model_config, page_size, reserve) -> int:
        heads = model_config.num_layers * model_config.num_kv_heads
        kept = np.maximum(*kept_and_windows(self.ratio, self.window, prompt_lengths))
        held = heads * (kept + chunk) / page_size + heads * (2 + -(-reserve // page_size))
        return int(np.ceil(held).sum())

    def after_prefill_chunk(self, kv: KVState, *, seen, prompt_lengths, budget_tokens):
        final = budget_column(budget_tokens, BUDGET_COLUMNS, "kept")
        window = budget_column(budget_tokens, BUDGET_COLUMNS, "window")
        total = _scaled_total(final, seen, prompt_lengths, _heads(kv))
        positions = kv.positions()
        newest = positions >= (seen - window)[None, :, None, None]
        return _evict_globally(kv, total, (positions < self.sinks) | newest)


@dataclasses.dataclass(frozen=True)
class BufferedDecodeEviction:
    """The decode eviction part: every `decode_buffer` steps each active sequence evicts
    globally to floor(r * current length) (or a fixed `decode_tokens`, the budget's "decode"
    column) per head on average, keeping its first `sinks` positions and newest
    `decode_buffer` tokens.
    """

    sinks: int
    decode_buffer: int

    @property
    def decode_interval(self) -> int:
        return self.decode_buffer

    def decode_tokens_bound(self, budget_tokens, prompt_lengths, max_new_tokens):
        grown = np.asarray(prompt_lengths) + max_new_tokens
        kept = np.floor(ratio_of(budget_tokens, prompt_lengths) * grown).astype(np.int64)
        fixed = budget_column(budget_tokens, BUDGET_COLUMNS, "decode")
        kept = np.where(fixed > 0, fixed, kept)
        # Each eviction keeps max(floor(r * length), the forced sinks + newest buffer) per head
        # on average; a buffer's worth of tokens arrives before the next one.
        prompt_kept = budget_column(budget_tokens, BUDGET_COLUMNS, "kept")
        held = np.maximum(np.maximum(kept, prompt_kept), self.sinks + self.decode_buffer)
        return np.minimum(held + self.decode_buffer, grown)

    def step_record(self, logits) -> None:
        del logits

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        active = ctx.positions >= 0
        heads = _heads(kv)
        current = ctx.positions + 1
        kept = budget_column(ctx.budget_tokens, BUDGET_COLUMNS, "kept")
        total = _scaled_total(kept, current, ctx.prompt_lengths, heads)
        fixed = budget_column(ctx.budget_tokens, BUDGET_COLUMNS, "decode")
        total = jnp.where(fixed > 0, fixed * heads, total)
        held_total = collectives.reduce_partial_sums(
            jnp.sum(kv.lengths, axis=(0, 2), dtype=jnp.int32)
        )
        total = jnp.where(active, total, held_total)
        positions = kv.positions()
        newest = positions > (ctx.positions - self.decode_buffer)[None, :, None, None]
        protected = (positions < self.sinks) | newest | ~active[None, :, None, None]
        return _evict_globally(kv, total, protected, max_moves=self.decode_buffer)


def ratio_of(budget_tokens, prompt_lengths) -> np.ndarray:
    """The kept share floor(r T) / T per prompt (r itself is stripped from the static copy)."""
    kept = budget_column(budget_tokens, BUDGET_COLUMNS, "kept")
    return kept / np.maximum(np.asarray(prompt_lengths), 1)


@dataclasses.dataclass(frozen=True)
class KeptWindowDecodeBudget:
    """Fast KVzip's budget part: int32 [B, 3] per prompt, the tokens kept per head after the
    prompt (floor(r T)), the protected window, and a fixed decode budget (0: the ratio r of the
    growing length). Attributes: as `FastKVzip`'s (None in the copy jit sees)."""

    share: float | None
    window: int | None
    decode_tokens: int | None

    columns: ClassVar[tuple[str, ...]] = BUDGET_COLUMNS

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        kept, windows = kept_and_windows(self.share, self.window, prompt_lengths)
        decode = np.full(kept.shape, self.decode_tokens or 0)
        return np.stack([kept, windows, decode], axis=1).astype(np.int32)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths):
        return within_budget(budget_tokens, prompt_lengths)


@register
@dataclasses.dataclass(frozen=True)
class FastKVzip(Policy):
    """Gate-scored eviction during chunked prefill and buffered decode (module docstring): the
    record of a `SinkAttentionGate`, a `ChunkedPrefillEviction` and a `BufferedDecodeEviction`,
    with the budget and the learned gates' parameters.

    Attributes:
      ratio: share of each sequence's KV pairs kept, in (0, 1]; stripped in the copy jit sees
        (it travels as `budget_tokens` [B, 3]: floor(r * T), the window w and `decode_tokens`
        (0 for the ratio rule) per prompt).
      window: protected newest tokens during prefill (None: `default_window`).
      sinks: first positions always kept (prefill and decode).
      decode_buffer: decode steps between evictions; the newest that many tokens stay.
      decode_tokens: a fixed decode budget (the paper's reasoning-model setting): each decode
        eviction goes down to this many tokens per head on average, instead of the ratio of the
        current length; a per-request value, stripped in the copy jit sees.
    """

    name: ClassVar[str] = "fastkvzip"
    decides_across_heads: ClassVar[bool] = True
    request_knobs: ClassVar[tuple[str, ...]] = ("ratio", "decode_tokens")

    ratio: float | None = None
    window: int | None = None
    sinks: int = 4
    decode_buffer: int = 128
    decode_tokens: int | None = None

    def _check(self) -> None:
        super()._check()
        if self.ratio is not None:
            Budget(ratio=self.ratio)  # raises unless 0 < ratio <= 1
        if self.window is not None and self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        if self.decode_tokens is not None and (
            isinstance(self.decode_tokens, bool)
            or not isinstance(self.decode_tokens, int | np.integer)
            or self.decode_tokens < 1
        ):
            raise ValueError(f"decode_tokens={self.decode_tokens!r} must be an integer >= 1")
        if self.sinks < 0 or self.decode_buffer < 1:
            raise ValueError(
                f"sinks={self.sinks} must be >= 0 and decode_buffer={self.decode_buffer} >= 1"
            )

    def _parts(self) -> dict:
        return {
            "gate": SinkAttentionGate(),
            "chunk_eviction": ChunkedPrefillEviction(self.ratio, self.window, self.sinks),
            "decode_eviction": BufferedDecodeEviction(self.sinks, self.decode_buffer),
            "params": SinkGateParams(),
            "budget_rule": KeptWindowDecodeBudget(self.ratio, self.window, self.decode_tokens),
        }

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        """The chunk must hold the window of every prompt it compresses (not of those kept
        whole)."""
        lengths = np.asarray(prompt_lengths)
        kept, windows = kept_and_windows(self.ratio, self.window, lengths)
        widest = int(np.max(windows, where=kept < lengths, initial=0))
        if chunk < widest:
            chosen = self.chunk_eviction.prefill_chunk(prompt_lengths, widest)
            raise ValueError(
                f"prefill_chunk={chunk} is smaller than the protected window w={widest}: "
                f"give prefill_chunk >= {widest} (or leave it out: this policy then prefills "
                f"in chunks of {chosen}), or a smaller window="
            )


@dataclasses.dataclass(frozen=True)
class SinkGateParams(LearnedParams):
    """Fast KVzip's trained sink-attention gates (`jaxkv.gates.fastkvzip`): a dict of
    [L, ...] arrays."""

    kind: ClassVar[str] = "fastkvzip"
    description: ClassVar[str] = "the trained gates (`jaxkv train fastkvzip` writes them)"

    def init(self, model_config, key):
        return gate.init_params(model_config, key)

    def load(self, path, model_config):
        """`path`: a gates .safetensors file, a directory holding `gates.safetensors`, or an
        orbax checkpoint directory."""
        path = Path(path)
        if path.is_dir() and (path / "gates.safetensors").exists():
            path = path / "gates.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"no Fast KVzip gates at {path}")
        if path.is_dir():
            if not (path / "_METADATA").exists() and not (path / "_CHECKPOINT_METADATA").exists():
                held = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
                raise ValueError(
                    f"no Fast KVzip gates at {path}: it holds neither gates.safetensors nor an "
                    f"orbax checkpoint (it holds {held}); train them (`jaxkv train fastkvzip`, "
                    "its training.json records the command) or give the gates' path"
                )
            return gate.load_orbax(path, model_config)
        return gate.load_safetensors(path, model_config)

    def check(self, params, model_config) -> None:
        gate.check_params(params, model_config)

    def axes(self, params):
        return {name: gate.PARAM_AXES[name] for name in params}
