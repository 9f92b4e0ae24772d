"""The parts a cache policy is made of, and the records they read.

A policy (`jaxkv.policies.Policy`) is a frozen record of optional parts, one per phase of a
request; a capability is a part being there (not None), so composing two policies is picking each
part from one of them, and no hook can be forgotten on the way:

  part                 phase    members
  admission            write    local_window, admit, prefill_pages (the pool grows as it fills)
  gate                 write    write_scores (a learned per-token score stored with the token)
  attention_scoring    attend   mass_weights, update_scores (the attention a token receives)
  selection            read     select_pages (the pages a decode step reads)
  prompt_compression   prefill  observation_window, needs_input_stats, needs_prompt_tokens,
                                query_moments_from, compress (which prompt tokens stay)
  chunk_eviction       prefill  prefill_chunk, prefill_pages, after_prefill_chunk
  decode_eviction      decode   decode_interval, decode_tokens_bound, on_decode, step_record

The protocols live here, below `layer_step` and `forward`, so that those type their policy
argument (`PolicyParts`) without importing the policies. Each part is an object of its own that
answers its protocol and nothing else (`tests/test_parts.py`), so the protocol is the only face
of a policy the engine sees.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVState, PagePool
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model

# The parts, in the order of a request.
PARTS = (
    "admission",
    "gate",
    "attention_scoring",
    "selection",
    "prompt_compression",
    "chunk_eviction",
    "decode_eviction",
)


@flax.struct.dataclass
class PrefillObservations:
    """What prefill recorded for `compress` (fields a policy does not ask for are None).

    Attributes:
      prompt_lengths: int32 [B].
      budget_tokens: int32 [B] (or [B, n] for policies with several budgets, columns named by
        `Policy.budget_columns`: `budget_column`) tokens per head.
      prompt_share: f32 [B] the budget as a share of the prompt, unrounded (0 for a token
        budget): PyramidKV's layer budgets read it as kvpress does.
      queries: [L, B, N, w, H] post-RoPE queries of each prompt's last w tokens (slot i holds
        position prompt_length - w + i; slots before position 0 are zero).
      input_mean, input_var: f32 [L, B, D] per-channel mean and unbiased variance of each
        layer's attention input (normed hidden state) over the prompt.
      key: PRNG key for stochastic policies.
      thresholds: f32 [B, n] the policy's thresholds (`Policy.thresholds`; None: it has none).
      prompt_tokens: int32 [B, T_pad] the right-padded prompts (None unless the prompt
        compression sets `needs_prompt_tokens`: KVzip replays them).
      query_mean, query_covariance: f32 [L, B, N, H] and [L, B, N, H, H] mean and population
        covariance of each query head's pre-RoPE queries over the prompt's positions from the
        compression's `query_moments_from` on (None unless it sets one: ExpectedAttention).
      policy_params: the policy's learned parameters, every leaf [L, ...] (None without):
        what a compression fitted ahead of the prompt reads (ExpectedAttention's statistics).
    """

    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    prompt_share: jax.Array
    queries: jax.Array | None
    input_mean: jax.Array | None
    input_var: jax.Array | None
    key: jax.Array
    thresholds: jax.Array | None = None
    prompt_tokens: jax.Array | None = None
    query_mean: jax.Array | None = None
    query_covariance: jax.Array | None = None
    policy_params: Any = None

    def query_positions(self) -> jax.Array:
        """int32 [B, w] the observed queries' positions, -1 for empty slots."""
        w = self.queries.shape[3]
        positions = self.prompt_lengths[:, None] - w + jnp.arange(w)
        return jnp.where(positions >= 0, positions, -1)


@flax.struct.dataclass
class DecodeContext:
    """Per-step values for `on_decode`.

    Attributes:
      prompt_lengths, budget_tokens: int32 [B] (budget_tokens [B, n] for policies with several).
      budget_ratio: f32 [B] the budget's ratio of the sequence (0 for a token budget).
      positions: int32 [B] position of the token just written (-1: a row that wrote none or
        whose eviction is not due this step, left as it is).
      logits: f32 [B, V] this step's next-token logits (before sampling).
      keys: uint32 [B, 2] each row's PRNG key of this step, for stochastic policies.
      thresholds: f32 [B, n] the policy's thresholds (`Policy.thresholds`; None: it has none).
      group_size: static G, query heads per KV head.
    """

    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    budget_ratio: jax.Array
    positions: jax.Array
    logits: jax.Array
    keys: jax.Array
    thresholds: jax.Array | None = None
    group_size: int = flax.struct.field(pytree_node=False, default=1)


@runtime_checkable
class Admission(Protocol):
    """Write time: which new tokens each (sequence, KV head) stores (WG-KV, DuoAttention)."""

    @property
    def local_window(self) -> int:
        """Slots of the local ring (WG-KV's band) read whole whatever is admitted; 0 for none."""

    def admit(
        self,
        *,
        layer: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        scores,
        thresholds,
    ) -> jax.Array:
        """bool [B, K, C] tokens to store. layer: int32 []; k, v [B, K, C, H]; positions
        [B, C] (-1 = padding); scores: the gate's f32 [B, K, C] (None without a gate);
        thresholds: the policy's f32 [B, n] (`Policy.thresholds`)."""

    def prefill_pages(
        self,
        prompt_lengths: np.ndarray,
        chunk: int,
        config: ModelConfig,
        page_size: int,
        reserve: int,
    ) -> int:
        """A first guess of the prefill pool's pages; the pool grows as admission fills it."""


@runtime_checkable
class Gate(Protocol):
    """Write time: a per-token score computed from the layer's slice of the policy's
    parameters and stored with the token (WG-KV's and Fast KVzip's learned gates)."""

    def write_scores(
        self,
        layer_params,
        *,
        h: jax.Array,
        q: jax.Array,
        k_unrotated: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions,
    ) -> jax.Array:
        """f32 [B, K, C]. h [B, C, D] the attention input; q [B, N, C, H] the queries after
        RoPE; k_unrotated, k [B, K, C, H] keys before and after RoPE; v [B, K, C, H] values;
        positions [B, C] (-1 = padding)."""


@runtime_checkable
class AttentionScoring(Protocol):
    """Attend time: every token's score accumulates the attention it receives (H2O, Conf-KV)."""

    def mass_weights(self, positions: jax.Array, thresholds) -> tuple[jax.Array, jax.Array]:
        """score <- decay * score + sum_i weight_i * mass_i: decay f32 [B] and per-query
        weights f32 [B, C] for a chunk's positions [B, C]; thresholds: the policy's f32 [B, n]
        (Conf-KV's decay is one, None for a policy without)."""

    def update_scores(
        self, old: jax.Array | None, mass: jax.Array, *, positions, cached_lengths, thresholds
    ) -> jax.Array:
        """f32 [B, K, S] the scores after a chunk; old: the slots' scores before it, or None
        for the chunk's own tokens; mass f32 [B, K, S] weighted by `mass_weights` and averaged
        over the KV head's query heads; cached_lengths int32 [B, K] (every tier)."""


@runtime_checkable
class Selection(Protocol):
    """Read time: the cached pages each head reads at a decode step (Quest)."""

    def select_pages(
        self, q: jax.Array, pool: PagePool, page_table, lengths, read_budget
    ) -> jax.Array:
        """bool [B, K, M] the pages each head reads, under `read_budget` int32 [B] tokens."""


@runtime_checkable
class PromptCompression(Protocol):
    """After prefill: which of the prompt's tokens stay (SnapKV, KVzip, GVote, ...)."""

    @property
    def observation_window(self) -> int:
        """How many of each prompt's last queries prefill records per layer."""

    @property
    def needs_input_stats(self) -> bool:
        """Whether prefill records the attention input's moments (GVote)."""

    @property
    def needs_prompt_tokens(self) -> bool:
        """Whether `compress` reads the prompt's ids (KVzip's replay)."""

    @property
    def query_moments_from(self) -> int | None:
        """The first position whose pre-RoPE query prefill adds to each head's mean and
        covariance (ExpectedAttention); None records none."""

    def compress(self, kv: KVState, obs: PrefillObservations, model: Model) -> KVState:
        """The state after prefill, compressed."""


@runtime_checkable
class ChunkEviction(Protocol):
    """During prefill: eviction after every chunk, so the pool holds the kept tokens plus one
    chunk (Fast KVzip)."""

    def prefill_chunk(self, prompt_lengths: np.ndarray, default: int) -> int:
        """Tokens per prefill chunk when the caller gives none."""

    def prefill_pages(
        self,
        prompt_lengths: np.ndarray,
        chunk: int,
        config: ModelConfig,
        page_size: int,
        reserve: int,
    ) -> int:
        """The prefill pool's bound in pages."""

    def after_prefill_chunk(
        self, kv: KVState, *, seen: jax.Array, prompt_lengths: jax.Array, budget_tokens: jax.Array
    ) -> KVState:
        """The state after a chunk is written; seen: int32 [B] prompt tokens written so far."""


@runtime_checkable
class DecodeEviction(Protocol):
    """During decode: eviction every `decode_interval` steps (H2O, StreamingLLM, Conf-KV)."""

    @property
    def decode_interval(self) -> int:
        """Decode steps between two evictions: a head overshoots its budget by up to that many
        tokens, and the compaction's cost is amortised over them."""

    def decode_tokens_bound(
        self, budget_tokens: np.ndarray, prompt_lengths: np.ndarray, max_new_tokens: int
    ) -> np.ndarray:
        """int [B]: the most tokens a head of each sequence holds at any decode step, on
        average over its (layer, KV head)s: the decode pool's size."""

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        """The state after a decode step on which eviction is due."""

    def step_record(self, logits: jax.Array) -> jax.Array | None:
        """f32 [B] the value this part reads from each step's logits [B, V], recorded per step
        in the generation's `policy_trace` (Conf-KV: its confidence), or None (no trace)."""


class PolicyParts(Protocol):
    """What the engine reads of a policy: its name and its parts (None when absent)."""

    name: str
    admission: Admission | None
    gate: Gate | None
    attention_scoring: AttentionScoring | None
    selection: Selection | None
    prompt_compression: PromptCompression | None
    chunk_eviction: ChunkEviction | None
    decode_eviction: DecodeEviction | None


PROTOCOLS = {
    "admission": Admission,
    "gate": Gate,
    "attention_scoring": AttentionScoring,
    "selection": Selection,
    "prompt_compression": PromptCompression,
    "chunk_eviction": ChunkEviction,
    "decode_eviction": DecodeEviction,
}


def present(policy: PolicyParts) -> tuple[str, ...]:
    """The names of the parts `policy` has, in `PARTS` order."""
    return tuple(name for name in PARTS if getattr(policy, name) is not None)


def local_window(policy: PolicyParts) -> int:
    """Slots of the local ring the policy's admission reads whole (0 without one)."""
    return 0 if policy.admission is None else policy.admission.local_window


def observation_window(policy: PolicyParts) -> int:
    """Last prompt queries recorded per layer for the prompt compression (0 without one)."""
    compression = policy.prompt_compression
    return 0 if compression is None else compression.observation_window


def budget_column(budget_tokens, columns: tuple[str, ...], name: str):
    """int32 [B]: the column `name` of a policy's budget array [B, n] (host or traced), whose
    columns its `budget_columns` name."""
    return budget_tokens[:, columns.index(name)]
