"""The cache-policy record: small frozen objects, static under jit.

A policy decides which tokens the cache keeps; how the cache holds them (page size, dtype, int8
tier) is the request's `jaxkv.cache.CacheConfig`. A policy is a frozen record whose fields are
its parts (`RECORD`), None unless the policy has them, each a small frozen object of one idea:
the engine's (`jaxkv.step.parts`: admission, gate, attention_scoring, selection,
prompt_compression, chunk_eviction, decode_eviction; `WGKV(...).gate` a `LearnedWriteGate`,
`SnapKV(...).prompt_compression` a `ScoredCompression` of SnapKV's `Scorer`) and the host's:

  params          a `LearnedParams`: WG-KV's write gates, Fast KVzip's sink-attention gates,
                  DuoAttention's retrieval heads (what they are, init, check, axes, and where
                  they come from: a path, the copy jaxkv ships for a model, the prompt itself)
  budget_rule     a `BudgetRule`: budget_tokens int32 [B] (or [B, n], named columns) per head,
                  checked on the host; the ratio of the growing sequence; the plan's bound
  threshold_set   a `ThresholdSet`: named thresholds (tau, ...) as f32 [B, n]

A registered class holds its settings as fields and builds its parts from them once, when it is
made (`_check`, `_parts`); every other member answers from the fields: `budget_tokens`,
`budget_ratio`, `planned_tokens`, `thresholds`, `static()` (the policy without its per-request
values, `request_knobs`: what jit sees), `check_prefill`, `for_tokenizer` (KVzip's own text in
the model's tokens), `check_params`/`check_model`.

Budgets vary per request, so they never reach jit as static fields: `generate` turns a policy's
`budget` into an int32 array [B] of tokens per head (`budget_tokens`) and compiles the policy with
its budget stripped (`static()`), so changing the budget does not recompile. Thresholds (WG-KV's
`tau`, Conf-KV's `tau`, `alpha` and `beta`) travel the same way, as f32 [B, n] (`thresholds`).
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeAlias, runtime_checkable

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


def with_budget(policy: Policy, budget: Budget | float | int) -> Policy:
    """`policy` with a request's own budget (`budget=`, or the `ratio=` of KVzip and Fast
    KVzip), as `get(name, budget=...)` reads it; a ValueError naming the policy's fields when it
    has no single per-request budget."""
    fields = [field.name for field in dataclasses.fields(policy) if field.init]
    if "budget" in fields and "budget" in policy.request_knobs:
        return dataclasses.replace(policy, budget=Budget.parse(budget))
    if "ratio" in policy.request_knobs:
        return dataclasses.replace(policy, ratio=_budget_as_ratio(policy.name, fields, budget))
    raise _no_single_budget(policy.name, fields, budget)


def _budget_as_ratio(name: str, fields: list[str], budget: Budget | float | int) -> float:
    """`budget=` for a policy without a `budget` field: its `ratio=`, or a named error."""
    if "ratio" not in fields:
        raise _no_single_budget(name, fields, budget)
    parsed = Budget.parse(budget)
    if parsed.ratio is None:
        raise ValueError(
            f"policy {name!r} takes its budget as a ratio of the prompt in (0, 1] "
            f"(ratio=), not a token count: got budget={budget!r}"
        )
    return parsed.ratio


def _no_single_budget(name: str, fields: list[str], budget) -> ValueError:
    if "tight" in fields and "loose" in fields:
        return ValueError(
            f"policy {name!r} takes no single budget: it has two token budgets, tight= and "
            "loose= (picked per step by confidence)"
        )
    known = f"its fields are {', '.join(fields)}" if fields else "it has no fields"
    return ValueError(f"policy {name!r} takes no budget (got budget={budget!r}); {known}")


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


@runtime_checkable
class BudgetRule(Protocol):
    """The budget part of a policy's record: how its `budget_tokens` arrays are made on the
    host (a policy without one keeps its whole prompt)."""

    @property
    def columns(self) -> tuple[str, ...]:
        """The names of the budget's columns ([B, n]); () for one budget, an array [B]."""

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        """int32 [B] (or [B, n]) tokens per head for these prompts, checked on the host."""

    def ratio(self, batch: int) -> np.ndarray:
        """f32 [B]: the budget as a share of the growing sequence (0: a token budget)."""

    def planned(
        self, budget_tokens: np.ndarray, prompt_lengths: np.ndarray
    ) -> tuple[np.ndarray, str]:
        """(int [B] the most a head holds once the prompts are compressed, how that is known)."""


@dataclasses.dataclass(frozen=True)
class ThresholdSet:
    """The thresholds part of a policy's record: named values (WG-KV's tau, Conf-KV's logit
    of tau, alpha and beta) that travel as an f32 array [B, n], so that a sweep over them
    compiles once.

    Attributes:
      owner: the policy's name, for errors.
      names: the columns.
      values: one per column, None in the copy jit sees (`Policy.static`).
    """

    owner: str
    names: tuple[str, ...]
    values: tuple[float, ...] | None

    def array(self, batch: int) -> np.ndarray:
        """f32 [B, n]: the values, the same for every row."""
        if self.values is None:
            raise ValueError(
                f"policy {self.owner!r} needs {', '.join(self.names)}= (none given, or a "
                "static() copy, whose thresholds travel as arrays)"
            )
        return np.tile(np.asarray(self.values, np.float32), (batch, 1))


# The fields of a policy's record: the engine's parts, then the host's (learned parameters,
# budget, thresholds). A composition takes each from the one policy that has it.
RECORD = (*parts.PARTS, "params", "budget_rule", "threshold_set")


def _part_field():
    """A record field: built from the policy's settings when it is made, so it is neither
    given nor compared (two policies of equal settings have equal parts)."""
    return dataclasses.field(default=None, init=False, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class of cache policies: a frozen record whose fields are its parts (`RECORD`),
    None unless the policy has them, so the base keeps every token.

    A subclass holds its settings as fields (`SnapKV(budget=0.3, window=64)`), checks them
    (`_check`) and builds its parts from them once (`_parts`); every other member answers from
    the fields. How the cache stores what a policy keeps (page size, dtype, int8 tier) is not
    the policy's: it is the request's `jaxkv.cache.CacheConfig`.
    """

    name: ClassVar[str] = "base"
    # Whether a budget is shared by a layer's or the model's KV heads (AdaKV, KVzip, Fast KVzip):
    # one head may keep more than its share, so on a mesh a device's pool is sized for its
    # heads keeping every head's share.
    decides_across_heads: ClassVar[bool] = False
    # The field a spec's bare VALUE sets (`policies.from_spec("snapkv:0.25")`): the budget for
    # most, a policy's own main knob otherwise (WG-KV's tau).
    primary_knob: ClassVar[str] = "budget"
    # The settings that vary per request (budgets, thresholds): `static()` strips them, so jit
    # sees them as arrays and changing them does not recompile.
    request_knobs: ClassVar[tuple[str, ...]] = ()

    admission: parts.Admission | None = _part_field()
    gate: parts.Gate | None = _part_field()
    attention_scoring: parts.AttentionScoring | None = _part_field()
    selection: parts.Selection | None = _part_field()
    prompt_compression: parts.PromptCompression | None = _part_field()
    chunk_eviction: parts.ChunkEviction | None = _part_field()
    decode_eviction: parts.DecodeEviction | None = _part_field()
    params: LearnedParams | None = _part_field()
    budget_rule: BudgetRule | None = _part_field()
    threshold_set: ThresholdSet | None = _part_field()

    def __post_init__(self):
        self._check()
        built = self._parts()
        unknown = set(built) - set(RECORD)
        if unknown:
            raise TypeError(f"{type(self).__name__}._parts(): {sorted(unknown)} not in RECORD")
        for field, part in built.items():
            object.__setattr__(self, field, part)

    def _check(self) -> None:
        """Validates (and normalises) the settings; subclasses call it first."""

    def _parts(self) -> dict[str, Any]:
        """The record's parts (`RECORD` names) built from the settings; none here."""
        return {}

    # --- the budget and the thresholds, from their parts, on the host ----------------------

    @property
    def budget_columns(self) -> tuple[str, ...]:
        """The names of the budget's columns ([B, n]; parts read one by its name:
        `jaxkv.step.parts.budget_column`), () for one budget [B]."""
        return () if self.budget_rule is None else self.budget_rule.columns

    def budget_tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        """int32 [B] tokens per head (or [B, n], `budget_columns`), checked against the
        prompts; the whole prompt for a policy without a budget."""
        if self.budget_rule is None:
            return np.asarray(prompt_lengths, np.int32)
        return self.budget_rule.tokens(prompt_lengths)

    def budget_ratio(self, batch: int) -> np.ndarray:
        """f32 [B]: the budget as a ratio of the sequence (0: a token budget or none)."""
        if self.budget_rule is None:
            return np.zeros((batch,), np.float32)
        return self.budget_rule.ratio(batch)

    def prompt_share(self, batch: int) -> np.ndarray:
        """f32 [B]: a prompt budget given as a share of the prompt, unrounded (0: a token
        budget, or a budget of another kind), what PyramidKV's layer budgets read."""
        rule = self.budget_rule
        if not isinstance(rule, PromptBudget) or rule.budget is None:
            return np.zeros((batch,), np.float32)
        return rule.budget.ratio_array(batch)

    def planned_tokens(
        self, budget_tokens: np.ndarray, prompt_lengths: np.ndarray
    ) -> tuple[np.ndarray, str]:
        """(int [B] the most tokens a head holds once the prompts are compressed, as `jaxkv
        bench plan` sizes a request from shapes alone; how that is known). budget_tokens:
        this policy's `budget_tokens(prompt_lengths)`."""
        if self.budget_rule is None:
            return np.asarray(prompt_lengths), "the whole prompt"
        return self.budget_rule.planned(budget_tokens, prompt_lengths)

    @property
    def threshold_names(self) -> tuple[str, ...]:
        """The columns of `thresholds` (() for a policy without any)."""
        return () if self.threshold_set is None else self.threshold_set.names

    def thresholds(self, batch: int) -> np.ndarray:
        """f32 [B, n]: the threshold values (columns `threshold_names`), the same for every
        row; what `static()` strips and jit sees as an array (n = 0 without thresholds)."""
        if self.threshold_set is None:
            return np.zeros((batch, 0), np.float32)
        return self.threshold_set.array(batch)

    def static(self) -> Policy:
        """This policy with per-request values (`request_knobs`: budgets, thresholds) removed:
        what jit sees."""
        if not self.request_knobs:
            return self
        return dataclasses.replace(self, **dict.fromkeys(self.request_knobs))

    # --- checks against the request and the model ----------------------------------------

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        """Validates the prefill geometry (chunk size against the prompts) on the host."""
        del prompt_lengths, chunk

    def for_tokenizer(self, tokenizer) -> Policy:
        """This policy with the text it feeds the model (KVzip's repeat prompt) written in
        `tokenizer`'s ids and chat template (`jaxkv.models.Tokenizer`); most feed none."""
        del tokenizer
        return self

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

    @staticmethod
    def saved_file(path: str | Path, filename: str, what: str) -> Path:
        """`path`, or `path / filename` where `path` is a directory; FileNotFoundError naming
        `what` (the file expected and the command writing it) when there is none."""
        path = Path(path)
        if path.is_dir():
            path = path / filename
        if not path.is_file():
            raise FileNotFoundError(f"no {what} at {path}")
        return path

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
class PromptBudget:
    """The budget part of a policy that keeps a share or a count of each prompt per head (the
    score-and-evict policies): `Budget.tokens_for`, or the whole prompt where that is fewer
    than the tokens every head protects (a prompt too short to compress around its sinks and
    window is kept whole). A token budget smaller than them is refused: it is wrong for every
    prompt long enough to compress.

    Attributes:
      owner: the policy's name, for errors.
      budget: a ratio of the prompt or a token count; None in the copy jit sees.
      protected: positions every head keeps whatever its budget (sinks and windows).
      grows: whether a ratio keeps its share of the growing sequence (`ratio`): a policy that
        evicts during decode too.
    """

    owner: str
    budget: Budget | None
    protected: int = 0
    grows: bool = False

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        if self.budget is None:
            raise ValueError(f"policy {self.owner!r} needs budget= (a ratio or a token count)")
        if self.budget.tokens is not None and self.budget.tokens < self.protected:
            raise ValueError(
                f"policy {self.owner!r}: budget of {self.budget.tokens} tokens is smaller than "
                f"the {self.protected} tokens each head protects (its sinks and window): give "
                f"budget >= {self.protected} tokens (or a ratio: a prompt too short for it is "
                "kept whole), or a smaller window/sinks"
            )
        tokens = self.budget.tokens_for(prompt_lengths)
        return keep_short_prompts_whole(tokens, prompt_lengths, self.protected)

    def ratio(self, batch: int) -> np.ndarray:
        if not self.grows or self.budget is None:
            return np.zeros((batch,), np.float32)
        return self.budget.ratio_array(batch)

    def planned(self, budget_tokens, prompt_lengths) -> tuple[np.ndarray, str]:
        return within_budget(budget_tokens, prompt_lengths)


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
