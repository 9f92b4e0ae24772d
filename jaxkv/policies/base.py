"""The cache-policy protocol: small frozen strategy objects, static under jit.

A policy decides which tokens the cache keeps; how the cache holds them (page size, dtype, int8
tier) is the request's `jaxkv.cache.CacheConfig`. Every hook has a keep-everything default, so
a policy implements only the groups it varies on. The whole protocol, by the phase that calls it:

  write     write_scores(...)      a learned per-token score (gate) from the layer's slice of
                                   the policy's parameters; stored with the token, seen by admit
            admit(...)             which new tokens each (sequence, KV head) stores
  scores    accumulates_attention  flag: fold the attention each token receives into its score
            mass_weights(...)      the fold's decay and per-query weights (Conf-KV's EMA)
            update_scores(...)     the fold itself, when not decay * old + mass (Scissorhands)
  read      selects_pages          flag: decode reads only `select_pages`' pages (Quest)
            select_pages(...)      bool [B, K, M] the pages each head reads
            local_window           slots of a local ring read whole (WG-KV's band)
  prefill   observation_window     last queries recorded for compress (SnapKV's window)
            needs_input_stats      flag: record attention-input moments (GVote)
            needs_prompt_tokens    flag: give compress the prompt's ids (KVzip)
            prefill_chunk(...)     the chunk size when the caller gives none
            check_prefill(...)     validate prompts x chunk on the host
            prefill_pages(...)     the prefill pool's bound; prefill_pool_grows: a first guess
            after_prefill_chunk    eviction between prefill chunks (Fast KVzip)
            compress(kv, obs, m)   after prefill, which cached tokens to keep (eviction)
  decode    evicts_during_decode   flag: run on_decode every `decode_interval` steps
            on_decode(kv, ctx)     eviction after a decode step
            decode_tokens_bound    the most tokens a head holds while decoding (pool size)
            step_confidence(...)   a per-step value read from the logits and recorded (Conf-KV)
  budgets   budget_tokens(...)     int32 [B] (or [B, n]) tokens per head, checked on the host
            budget_ratio(...)      f32 [B] the budget as a share of the growing sequence
            static()               the policy without per-request values: what jit sees
            decides_across_heads   flag: one budget shared by heads (pool sizing on a mesh)
  params    needs_params           flag: runs only with `policy_params` (learned gates)
            init_params / load_params  fresh ones / saved ones read from a path
            check_params(...)      validate the parameters against the model
            param_axes(...)        their logical axes, to shard them with their KV heads

Budgets vary per request, so they never reach jit as static fields: `generate` turns a policy's
`budget` into an int32 array [B] of tokens per head (`budget_tokens`) and compiles the policy with
its budget stripped (`static()`), so changing the budget does not recompile.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, TypeAlias

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVState, PagePool
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model

# A policy's learned parameters: a pytree of arrays, every leaf stacked [L, ...] (gates).
PolicyParams: TypeAlias = Any

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: makes `cls` available as `policies.get(cls.name, ...)`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str, **kwargs: Any) -> Policy:
    """Builds a registered policy by name, e.g. `get("snapkv", budget=0.3)`.

    `budget=` is the one budget vocabulary (a ratio of the prompt or a token count): a policy
    that takes its ratio as `ratio=` (KVzip, Fast KVzip) gets it there; a policy without a
    budget, or with budgets of its own (Conf-KV's `tight=`/`loose=`), raises a ValueError
    saying so, as does any keyword that is not one of the policy's fields.
    """
    if name not in _REGISTRY:
        raise KeyError(f"policy={name!r}: registered policies are {sorted(_REGISTRY)}")
    cls = _REGISTRY[name]
    fields = [field.name for field in dataclasses.fields(cls) if field.init]
    if "budget" in kwargs and "budget" not in fields:
        kwargs = dict(kwargs)
        budget = kwargs.pop("budget")
        if budget is not None:
            kwargs["ratio"] = _budget_as_ratio(name, fields, budget)
    unknown = [key for key in kwargs if key not in fields]
    if unknown:
        raise ValueError(
            f"policy {name!r} has no field {unknown[0]!r}: its fields are {', '.join(fields)}"
        )
    return cls(**kwargs)


def _budget_as_ratio(name: str, fields: list[str], budget: Budget | float | int) -> float:
    """`budget=` for a policy without a `budget` field: its `ratio=`, or a named error."""
    if "ratio" in fields:
        parsed = Budget.parse(budget)
        if parsed.ratio is None:
            raise ValueError(
                f"policy {name!r} takes its budget as a ratio of the prompt in (0, 1] "
                f"(ratio=), not a token count: got budget={budget!r}"
            )
        return parsed.ratio
    if "tight" in fields and "loose" in fields:
        raise ValueError(
            f"policy {name!r} takes no single budget: it has two token budgets, tight= and "
            "loose= (picked per step by confidence)"
        )
    raise ValueError(
        f"policy {name!r} takes no budget (got budget={budget!r}); its fields are "
        f"{', '.join(fields)}"
    )


def registered() -> list[str]:
    """The names `get` accepts, sorted."""
    return sorted(_REGISTRY)


# Token budgets travel as int32 arrays.
MAX_BUDGET_TOKENS = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Tokens kept per (layer, sequence, KV head): a ratio of the prompt or a token count."""

    ratio: float | None = None
    tokens: int | None = None

    def __post_init__(self):
        if (self.ratio is None) == (self.tokens is None):
            raise ValueError("a Budget needs exactly one of ratio= or tokens=")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"budget ratio={self.ratio} must be in (0, 1]")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"budget tokens={self.tokens} must be >= 1")

    @classmethod
    def parse(cls, value: Budget | float | int) -> Budget:
        """A float is a ratio of the prompt, an int a token count (Python, numpy or 0-d jax
        scalars alike); a ValueError naming the allowed forms otherwise."""
        if isinstance(value, Budget):
            return value
        bad = ValueError(
            f"budget={value!r}: give a ratio in (0, 1] or a token count in [1, {MAX_BUDGET_TOKENS}]"
        )
        if np.ndim(value) != 0:
            raise bad
        kind = np.asarray(value).dtype.kind  # bools, strings and huge ints are neither
        if kind == "f":
            return cls(ratio=float(value))
        if kind not in "iu" or not 1 <= int(value) <= MAX_BUDGET_TOKENS:
            raise bad
        return cls(tokens=int(value))

    def tokens_for(self, prompt_lengths: np.ndarray) -> np.ndarray:
        """int32 [B] tokens per head for these prompts: floor(ratio * length) (at least 1), or
        the token count. A budget is a cap, not a target: a count above the prompt keeps the
        whole prompt, and decode-time eviction starts only once a head holds more."""
        lengths = np.asarray(prompt_lengths)
        if self.ratio is not None:
            return np.maximum(1, np.floor(self.ratio * lengths)).astype(np.int32)
        return np.full(lengths.shape, self.tokens, np.int32)

    def ratio_array(self, batch: int) -> np.ndarray:
        """f32 [B]: the ratio (0 for a token count), which decode applies to the current
        length, so that a ratio keeps its share of a growing sequence (1.0 never evicts)."""
        return np.full((batch,), 0.0 if self.ratio is None else self.ratio, np.float32)


@flax.struct.dataclass
class PrefillObservations:
    """What prefill recorded for `compress` (fields a policy does not ask for are None).

    Attributes:
      prompt_lengths: int32 [B].
      budget_tokens: int32 [B] (or [B, n] for policies with several budgets) tokens per head.
      queries: [L, B, N, w, H] post-RoPE queries of each prompt's last w tokens (slot i holds
        position prompt_length - w + i; slots before position 0 are zero).
      input_mean, input_var: f32 [L, B, D] per-channel mean and unbiased variance of each
        layer's attention input (normed hidden state) over the prompt.
      key: PRNG key for stochastic policies.
      prompt_tokens: int32 [B, T_pad] the right-padded prompts (None unless the policy sets
        `needs_prompt_tokens`: KVzip replays them).
    """

    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    queries: jax.Array | None
    input_mean: jax.Array | None
    input_var: jax.Array | None
    key: jax.Array
    prompt_tokens: jax.Array | None = None

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
      positions: int32 [B] position of the token just written (-1 for finished sequences).
      logits: f32 [B, V] this step's next-token logits (before sampling).
      key: PRNG key of this step for stochastic policies.
      step: int32 [] decode tokens written so far, this one included (on_decode runs on the
        steps where step % `decode_interval` == 0).
      group_size: static G, query heads per KV head.
    """

    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    budget_ratio: jax.Array
    positions: jax.Array
    logits: jax.Array
    key: jax.Array
    step: jax.Array
    group_size: int = flax.struct.field(pytree_node=False, default=1)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class of cache policies; every hook defaults to keeping everything.

    How the cache stores what a policy keeps (page size, dtype, int8 tier) is not the
    policy's: it is the request's `jaxkv.cache.CacheConfig`.
    """

    name: ClassVar[str] = "base"
    # Whether every token's received attention mass is accumulated into its score (H2O).
    accumulates_attention: ClassVar[bool] = False
    # Whether prefill records per-layer attention-input statistics (GVote).
    needs_input_stats: ClassVar[bool] = False
    # Whether decode reads only pages chosen by `select_pages` (needs per-page key bounds).
    selects_pages: ClassVar[bool] = False
    # Whether the policy runs only with `policy_params` (learned gates, calibrated head choices).
    needs_params: ClassVar[bool] = False
    # Whether `compress` reads the prompt's token ids (`PrefillObservations.prompt_tokens`).
    needs_prompt_tokens: ClassVar[bool] = False
    # Whether a budget is shared by a layer's or the model's KV heads (AdaKV, KVzip, Fast KVzip):
    # one head may keep more than its share, so on a mesh a device's pool is sized for its
    # heads keeping every head's share.
    decides_across_heads: ClassVar[bool] = False
    # Whether what prefill holds is known only as tokens are admitted: `prefill_pages` is then
    # a first guess, and the pool grows during prefill as it fills (admission policies).
    prefill_pool_grows: ClassVar[bool] = False
    # The field a spec's bare VALUE sets (`policies.from_spec("snapkv:0.25")`): the budget for
    # most, a policy's own main knob otherwise (WG-KV's tau).
    primary_knob: ClassVar[str] = "budget"

    def __post_init__(self):
        """Validates the fields (subclasses call it first); nothing to check here."""

    @property
    def observation_window(self) -> int:
        """How many of each prompt's last queries prefill records per layer for `compress`."""
        return 0

    @property
    def local_window(self) -> int:
        """Slots of the local ring (WG-KV's band) the KV state keeps per (layer, sequence, KV
        head), read whatever the admission; 0 for no ring (admission then decides the write)."""
        return 0

    # Whether `on_decode` may evict (then it runs every `decode_interval` steps).
    evicts_during_decode: ClassVar[bool] = False

    def budget_tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        """int32 [B] (or [B, n]) tokens per head; checks budgets against the prompts (host side)."""
        return np.asarray(prompt_lengths, np.int32)

    def budget_ratio(self, batch: int) -> np.ndarray:
        """f32 [B]: the budget as a ratio of the sequence (0: a token budget or none)."""
        return np.zeros((batch,), np.float32)

    @property
    def decode_interval(self) -> int:
        """Decode steps between two `on_decode` calls. Eviction during decode compacts the
        cache, which costs as much as reading it: a policy that evicts every `n` steps lets its
        heads overshoot the budget by up to `n` tokens and amortises that cost over `n` steps."""
        return 1

    def decode_tokens_bound(
        self, budget_tokens: np.ndarray, prompt_lengths: np.ndarray, max_new_tokens: int
    ) -> np.ndarray | None:
        """int [B]: the most tokens a head of each sequence holds at any decode step, on
        average over the sequence's (layer, KV head)s, so that the decode pool is sized by
        the budget rather than by prompt + generation; None when the cache only grows."""
        del budget_tokens, prompt_lengths, max_new_tokens
        return None

    def prefill_chunk(self, prompt_lengths: np.ndarray, default: int) -> int:
        """Tokens per prefill chunk when the caller gives none (`default` unless the policy's
        method prescribes its own, as Fast KVzip's chunked-prefill eviction does)."""
        del prompt_lengths
        return default

    def step_confidence(self, logits: jax.Array) -> jax.Array | None:
        """f32 [B] what the policy reads from each step's next-token logits [B, V] and
        `generate` records per step (Conf-KV's confidence); None for policies that read none."""
        del logits
        return None

    def static(self) -> Policy:
        """This policy with per-request values removed: what jit sees."""
        return self

    def for_tokenizer(self, tokenizer) -> Policy:
        """This policy with the text it feeds the model (KVzip's repeat prompt) written in
        `tokenizer`'s ids and chat template (`jaxkv.models.Tokenizer`); most feed none."""
        del tokenizer
        return self

    def mass_weights(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """How a chunk's attention updates accumulated scores (when `accumulates_attention`):
        score <- decay * score + sum_i weight_i * mass_i. Returns decay f32 [B] and per-query
        weights f32 [B, C] for positions [B, C]; by default a plain sum over valid queries.
        """
        return jnp.ones(positions.shape[:1], jnp.float32), (positions >= 0).astype(jnp.float32)

    def update_scores(
        self,
        old: jax.Array | None,
        mass: jax.Array,
        *,
        positions: jax.Array,
        cached_lengths: jax.Array,
    ) -> jax.Array:
        """f32 [B, K, S] the scores after a chunk (when `accumulates_attention`).

        old: f32 [B, K, S] the cached slots' scores before the chunk, or None for the chunk's
        own tokens, whose scores start here; mass: f32 [B, K, S] the attention the chunk's
        queries gave each slot, weighted by `mass_weights` and averaged over the KV head's
        query heads; positions: int32 [B, C] the chunk's; cached_lengths: int32 [B, K] the
        tokens each head held before the chunk (every tier). By default decay * old + mass
        (`mass_weights`' decay), and a new token's mass.
        """
        del cached_lengths
        if old is None:
            return mass
        decay, _ = self.mass_weights(positions)
        return decay[:, None, None] * old + mass

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        """Validates the prefill geometry (chunk size against the prompts) on the host."""
        del prompt_lengths, chunk

    def prefill_pages(
        self,
        prompt_lengths: np.ndarray,
        chunk: int,
        model_config: ModelConfig,
        page_size: int,
        reserve: int,
    ) -> int | None:
        """Pages the prefill pool needs when the caller gives no num_pages; None: the full
        cache's need (prompts plus `reserve` tokens per head). A policy that evicts during
        prefill returns its bound, so the pool array itself stays small."""
        del prompt_lengths, chunk, model_config, page_size, reserve
        return None

    def after_prefill_chunk(
        self, kv: KVState, *, seen: jax.Array, prompt_lengths: jax.Array, budget_tokens: jax.Array
    ) -> KVState:
        """The state after a prefill chunk is written; identity by default.

        seen: int32 [B] prompt tokens written so far (the chunk's end, at most the length);
        prompt_lengths: int32 [B]; budget_tokens: as `budget_tokens` returned on the host.
        """
        del seen, prompt_lengths, budget_tokens
        return kv

    def init_params(self, model_config: ModelConfig, key: jax.Array) -> PolicyParams | None:
        """Fresh (untrained) `policy_params` for the model, of the shapes `check_params` takes;
        None for a policy without parameters. Benchmarks plan with their shapes."""
        del model_config, key
        return None

    def load_params(self, path: str | Path, model_config: ModelConfig) -> PolicyParams:
        """Saved `policy_params` (trained gates, chosen heads) read from `path` and checked
        against the model; a policy without parameters refuses."""
        del model_config
        raise ValueError(f"policy {self.name!r} takes no policy_params (given {path})")

    def check_params(self, params: PolicyParams | None, model_config: ModelConfig) -> None:
        """Validates `policy_params` against the model on the host; raises ValueError.

        A policy without parameters accepts only None.
        """
        del model_config
        if params is not None:
            raise ValueError(f"policy {self.name!r} takes no policy_params, got some")

    def param_axes(self, params: PolicyParams | None) -> PolicyParams | None:
        """The logical axis names of each `policy_params` leaf (a tree like `params` with a
        tuple per leaf, `jaxkv.collectives.LOGICAL_AXIS_RULES`), so that a mesh splits learned
        gates with their KV heads; None: replicated (no parameters)."""
        del params
        return None

    def write_scores(
        self,
        layer_params: PolicyParams | None,
        *,
        h: jax.Array,
        k_unrotated: jax.Array,
        k: jax.Array,
        positions: jax.Array,
    ) -> jax.Array | None:
        """f32 [B, K, C] per-token scores computed when a chunk is written, or None.

        layer_params: this layer's slice of the policy's parameters (None without any);
        h [B, C, D] the attention input (normed hidden state); k_unrotated, k [B, K, C, H] keys
        before and after RoPE; positions [B, C] (-1 = padding).
        """
        del layer_params, h, k_unrotated, k, positions
        return None

    def admit(
        self,
        *,
        layer: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        scores: jax.Array | None = None,
    ) -> jax.Array | None:
        """bool [B, K, C] tokens to store, or None to store every valid token.

        layer: int32 [] index of the layer; k, v [B, K, C, H]; positions [B, C] (-1 = padding);
        scores: this chunk's `write_scores` (None when the policy computes none).
        """
        del layer, k, v, positions, scores
        return None

    def select_pages(
        self,
        q: jax.Array,
        pool: PagePool,
        page_table: jax.Array,
        lengths: jax.Array,
        read_budget: jax.Array,
    ) -> jax.Array:
        """bool [B, K, M]: the cached pages each head reads this decode step (selection)."""
        raise NotImplementedError(f"policy {self.name!r} does not select pages")

    def compress(self, kv: KVState, obs: PrefillObservations, model: Model) -> KVState:
        """The state after prefill, compressed; identity by default."""
        del obs, model
        return kv

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        """The state after a decode step; identity by default."""
        del ctx
        return kv


@register
@dataclasses.dataclass(frozen=True)
class FullCache(Policy):
    """Keep every token: the uncompressed baseline."""

    name: ClassVar[str] = "full"


def after_decode_step(policy: Policy, kv: KVState, ctx: DecodeContext) -> KVState:
    """The state after a decode step: the policy's `on_decode` on the steps it is due
    (ctx.step % `decode_interval` == 0), skipped (not run and discarded) on the others."""
    if not policy.evicts_during_decode:
        return kv
    due = ctx.step % policy.decode_interval == 0
    return jax.lax.cond(due, lambda kv: policy.on_decode(kv, ctx), lambda kv: kv, kv)
