"""The cache-policy record: small frozen objects, static under jit.

A policy decides which tokens the cache keeps; how the cache holds them (page size, dtype, int8
tier) is the request's `jaxkv.cache.CacheConfig`. A policy is a record of optional parts
(`jaxkv.step.parts`: admission, gate, attention_scoring, selection, prompt_compression,
chunk_eviction, decode_eviction), None unless the policy has them, each a small frozen object of
one idea (`WGKV.gate` a `LearnedWriteGate`, `SnapKV.prompt_compression` a `ScoredCompression`
of its scores). Besides its parts it answers on the host:

  budgets   budget_tokens(...)     int32 [B] (or [B, n], columns `budget_columns`) tokens per
                                   head, checked on the host
            budget_ratio(...)      f32 [B] the budget as a share of the growing sequence
            thresholds(...)        f32 [B, n] thresholds (tau, ...), columns `threshold_names`
            planned_tokens(...)    int [B] the most a head holds after the prompt (plans)
            static()               the policy without per-request values: what jit sees
            decides_across_heads   flag: one budget shared by heads (pool sizing on a mesh)
  prefill   check_prefill(...)     validate prompts x chunk
  text      for_tokenizer(...)     the policy with its own text in the model's tokens (KVzip)
  model     check_params(...)      validate `policy_params` (with the `params` part) and the
                                   policy against the model

Its learned parameters are a part too, `params` (a `LearnedParams`: WG-KV's write gates, Fast
KVzip's sink-attention gates, DuoAttention's retrieval heads), None for a policy that runs
without any: what they are (init, check, axes) and where they come from (a path, the copy jaxkv
ships for a model, the request's own prompt).

Budgets vary per request, so they never reach jit as static fields: `generate` turns a policy's
`budget` into an int32 array [B] of tokens per head (`budget_tokens`) and compiles the policy with
its budget stripped (`static()`), so changing the budget does not recompile. Thresholds (WG-KV's
`tau`, Conf-KV's `tau`, `alpha` and `beta`: `threshold_names`) travel the same way, as f32
[B, n] (`thresholds`).
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, ClassVar, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import bundled
from jaxkv.models.configs import ModelConfig
from jaxkv.step import parts

# A policy's learned parameters: a pytree of arrays, every leaf stacked [L, ...] (gates).
PolicyParams: TypeAlias = Any

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: makes `cls` available as `policies.get(cls.name, ...)`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    """The class registered as `name` (a ValueError naming the registered ones otherwise, as
    `generate(policy="nosuch")` raises)."""
    if name not in _REGISTRY:
        raise ValueError(f"policy={name!r}: registered policies are {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get(name: str, **kwargs: Any) -> Policy:
    """Builds a registered policy by name, e.g. `get("snapkv", budget=0.3)`.

    `budget=` is the one budget vocabulary (a ratio of the prompt or a token count): a policy
    that takes its ratio as `ratio=` (KVzip, Fast KVzip) gets it there; a policy without a
    budget, or with budgets of its own (Conf-KV's `tight=`/`loose=`), raises a ValueError
    saying so, as does any keyword that is not one of the policy's fields.
    """
    cls = policy_class(name)
    fields = [field.name for field in dataclasses.fields(cls) if field.init]
    if "budget" in kwargs and "budget" not in fields:
        kwargs = dict(kwargs)
        budget = kwargs.pop("budget")
        if budget is not None:
            kwargs["ratio"] = _budget_as_ratio(name, fields, budget)
    unknown = [key for key in kwargs if key not in fields]
    if unknown:
        known = f"its fields are {', '.join(fields)}" if fields else "it has no fields"
        raise ValueError(f"policy {name!r} has no field {unknown[0]!r}: {known}")
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
    known = f"its fields are {', '.join(fields)}" if fields else "it has no fields"
    raise ValueError(f"policy {name!r} takes no budget (got budget={budget!r}); {known}")


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


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class of cache policies: a frozen record of optional parts (`jaxkv.step.parts`), none by
    default, so the base keeps every token.

    How the cache stores what a policy keeps (page size, dtype, int8 tier) is not the
    policy's: it is the request's `jaxkv.cache.CacheConfig`.
    """

    name: ClassVar[str] = "base"
    # Whether a budget is shared by a layer's or the model's KV heads (AdaKV, KVzip, Fast KVzip):
    # one head may keep more than its share, so on a mesh a device's pool is sized for its
    # heads keeping every head's share.
    decides_across_heads: ClassVar[bool] = False
    # The field a spec's bare VALUE sets (`policies.from_spec("snapkv:0.25")`): the budget for
    # most, a policy's own main knob otherwise (WG-KV's tau).
    primary_knob: ClassVar[str] = "budget"

    def __post_init__(self):
        """Validates the fields (subclasses call it first); nothing to check here."""

    # --- parts (`jaxkv.step.parts`): None when the policy has no such part ---------------------

    @property
    def admission(self) -> parts.Admission | None:
        return None

    @property
    def gate(self) -> parts.Gate | None:
        return None

    @property
    def attention_scoring(self) -> parts.AttentionScoring | None:
        return None

    @property
    def selection(self) -> parts.Selection | None:
        return None

    @property
    def prompt_compression(self) -> parts.PromptCompression | None:
        return None

    @property
    def chunk_eviction(self) -> parts.ChunkEviction | None:
        return None

    @property
    def decode_eviction(self) -> parts.DecodeEviction | None:
        return None

    # --- budgets, checked and turned into arrays on the host -------------------------------

    # The names of the budget's columns for a policy with several budgets (Conf-KV's tight and
    # loose); () for one budget, an array [B]. Parts read a column by its name
    # (`jaxkv.step.parts.budget_column`).
    budget_columns: ClassVar[tuple[str, ...]] = ()

    def budget_tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        """int32 [B] tokens per head, or [B, n] with the columns `budget_columns`; checks
        budgets against the prompts (host side)."""
        return np.asarray(prompt_lengths, np.int32)

    def budget_ratio(self, batch: int) -> np.ndarray:
        """f32 [B]: the budget as a ratio of the sequence (0: a token budget or none)."""
        return np.zeros((batch,), np.float32)

    # The policy's thresholds (fields such as WG-KV's `tau`), in the column order of
    # `thresholds`: they travel as arrays, so a sweep over their values compiles once.
    threshold_names: ClassVar[tuple[str, ...]] = ()

    def thresholds(self, batch: int) -> np.ndarray:
        """f32 [B, n]: the values of `threshold_names` (columns), the same for every row; what
        `static()` strips and jit sees as an array (n = 0 for a policy without any)."""
        values = [getattr(self, name) for name in self.threshold_names]
        if any(value is None for value in values):
            raise ValueError(f"policy {self.name!r}: thresholds of a static() policy are gone")
        return np.tile(np.asarray(values, np.float32), (batch, 1))

    def threshold(self, thresholds: jax.Array, name: str) -> jax.Array:
        """f32 [B]: the column `name` of a `thresholds` array (traced)."""
        if thresholds is None:
            raise ValueError(f"policy {self.name!r} reads its {name} from thresholds: give them")
        return thresholds[:, self.threshold_names.index(name)]

    def planned_tokens(
        self, budget_tokens: np.ndarray, prompt_lengths: np.ndarray
    ) -> tuple[np.ndarray, str]:
        """(int [B] the most tokens a head holds once the prompts are compressed, as `jaxkv
        bench plan` sizes a request from shapes alone; how that is known). budget_tokens:
        this policy's `budget_tokens(prompt_lengths)`."""
        del budget_tokens
        return np.asarray(prompt_lengths), "the whole prompt"

    def static(self) -> Policy:
        """This policy with per-request values (budgets, `threshold_names`) removed: what jit
        sees."""
        if not self.threshold_names:
            return self
        return dataclasses.replace(self, **dict.fromkeys(self.threshold_names))

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        """Validates the prefill geometry (chunk size against the prompts) on the host."""
        del prompt_lengths, chunk

    def for_tokenizer(self, tokenizer) -> Policy:
        """This policy with the text it feeds the model (KVzip's repeat prompt) written in
        `tokenizer`'s ids and chat template (`jaxkv.models.Tokenizer`); most feed none."""
        del tokenizer
        return self

    # --- learned parameters and the model ----------------------------------------------------

    @property
    def params(self) -> LearnedParams | None:
        """The learned-parameters part: what `policy_params` this policy runs with (None: it
        takes none)."""
        return None

    def check_params(self, params: PolicyParams | None, model_config: ModelConfig) -> None:
        """Validates `policy_params` against the `params` part (None for a policy without one)
        and the policy against the model (`check_model`) on the host; raises ValueError."""
        part = self.params
        if part is None and params is not None:
            raise ValueError(f"policy {self.name!r} takes no policy_params, got some")
        if part is not None and params is None:
            raise ValueError(f"policy {self.name!r} needs policy_params: {part.description}")
        if part is not None:
            part.check(params, model_config)
        self.check_model(model_config)

    def check_model(self, model_config: ModelConfig) -> None:
        """Validates the policy against the model on the host (KVzip's repeat prompt against
        the vocabulary); most fit every model."""
        del model_config


class LearnedParams(abc.ABC):
    """The learned-parameters part of a policy (`Policy.params`): its `policy_params`, what
    they are and where they come from. Subclasses are frozen dataclasses of the policy's
    fields they read.

    Attributes:
      kind: the key of these parameters in `jaxkv.bundled.SHIPPED_PARAMS` (the trainer's name).
      description: what to give when they are missing, for errors.
    """

    kind: ClassVar[str]
    description: ClassVar[str]

    @abc.abstractmethod
    def init(self, model_config: ModelConfig, key: jax.Array) -> PolicyParams:
        """Fresh (untrained) parameters of the shapes `check` takes; plans use their shapes."""

    @abc.abstractmethod
    def load(self, path: str | Path, model_config: ModelConfig) -> PolicyParams:
        """Saved parameters read from `path` and checked against the model."""

    @abc.abstractmethod
    def check(self, params: PolicyParams, model_config: ModelConfig) -> None:
        """Validates parameters against the model on the host; raises ValueError."""

    @abc.abstractmethod
    def axes(self, params: PolicyParams) -> Any:
        """The logical axis names of each leaf (a tree like `params`, a tuple per leaf;
        `jaxkv.collectives.LOGICAL_AXIS_RULES`), so that a mesh splits them with their KV
        heads."""

    def from_prompt(self, model, prompt_ids: list[int]) -> PolicyParams | None:
        """Parameters picked on the request's own prompt (ids without padding) when none are
        given, e.g. DuoAttention's retrieval heads; None for parameters that must be learned."""
        del model, prompt_ids
        return None

    def shipped_path(self, model_name: str | None) -> Path | None:
        """Where jaxkv ships trained parameters for the model named `model_name`
        (`jaxkv.bundled.REFERENCE` or a fetched model's name; package data, read by `load`),
        or None: the caller gives them."""
        return bundled.shipped_params_path(self.kind, model_name)


def within_budget(budget_tokens: np.ndarray, prompt_lengths: np.ndarray) -> tuple[np.ndarray, str]:
    """`Policy.planned_tokens` of a policy that compresses each head to its budget: int [B] the
    budget (its first column) or the prompt where that is shorter."""
    lengths = np.asarray(prompt_lengths)
    budget = np.asarray(budget_tokens).reshape(len(lengths), -1)[:, 0]
    return np.minimum(budget, lengths), "the budget per head"


def keep_short_prompts_whole(tokens, prompt_lengths, least) -> np.ndarray:
    """int32 [B]: `tokens` per head, or the whole prompt where that is fewer than `least` (what
    a policy keeps of every prompt it compresses: its sinks and windows), so that a prompt too
    short to compress to its budget is kept whole. tokens, least: int [B] or scalars."""
    lengths = np.asarray(prompt_lengths)
    return np.where(tokens < least, lengths, tokens).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PromptCompressionPart:
    """Base of the prompt compression parts: what prefill records for `compress`, by default
    nothing (no queries, moments or prompt ids); a part sets what it reads."""

    observation_window: ClassVar[int] = 0
    needs_input_stats: ClassVar[bool] = False
    needs_prompt_tokens: ClassVar[bool] = False
    query_moments_from: ClassVar[int | None] = None


@dataclasses.dataclass(frozen=True)
class SummedMass:
    """The attention scoring part of H2O and observed attention: each token's score is the
    attention it has received, summed over every query (averaged over the KV head's query
    heads). Conf-KV's `DecayedMass` overrides `mass_weights`, Scissorhands'
    `UnimportanceCount` `update_scores`."""

    def mass_weights(self, positions: jax.Array, thresholds) -> tuple[jax.Array, jax.Array]:
        """decay f32 [B] (1) and per-query weights f32 [B, C] (1 for valid queries)."""
        del thresholds
        return jnp.ones(positions.shape[:1], jnp.float32), (positions >= 0).astype(jnp.float32)

    def update_scores(
        self,
        old: jax.Array | None,
        mass: jax.Array,
        *,
        positions: jax.Array,
        cached_lengths: jax.Array,
        thresholds,
    ) -> jax.Array:
        """decay * old + mass (`mass_weights`' decay), and a new token's mass."""
        del cached_lengths
        if old is None:
            return mass
        decay, _ = self.mass_weights(positions, thresholds)
        return decay[:, None, None] * old + mass


@register
@dataclasses.dataclass(frozen=True)
class FullCache(Policy):
    """Keep every token: the uncompressed baseline."""

    name: ClassVar[str] = "full"
