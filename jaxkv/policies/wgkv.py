"""WG-KV write-gated admission and the static admission baselines that share its dual cache.

Every policy here keeps a local ring of the last `window` tokens per (layer, sequence, KV head),
read whatever the gate, and promotes a token leaving the ring to the global paged cache iff its
gate value g > tau (lazy promotion, `jaxkv.cache.ring`). They differ only in where g comes from:
  WGKV            the learned write gate (`jaxkv.gates.wgkv`) on the token's keys;
  LocalAttention  1 for the first `sinks` positions, else 0 (sinks + sliding window);
  DuoAttention    1 for every token of a retrieval head, else as LocalAttention (streaming head).
A query at position i thus reads every admitted token and the band i - j < window: prefill is the
paper's vertical-slash pattern, chunk by chunk, and decode the same path with one token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import attention as attention_ops
from jaxkv.gates.wgkv import (
    PARAM_AXES,
    check_write_gates,
    init_write_gates,
    load_write_gates,
    write_gate_values,
)
from jaxkv.policies import base

# The thresholds of every policy here (their `threshold_names`): tau, column 0.
THRESHOLD_NAMES = ("tau",)
# The share of a prompt the prefill pool is first sized for; it grows when more is admitted.
ADMITTED_GUESS = 0.25


@dataclasses.dataclass(frozen=True)
class ThresholdAdmission:
    """The admission part: a token is stored in the global cache iff its gate value g > tau
    (the policy's threshold, an array: a tau sweep compiles once); a local ring of `window`
    slots per head holds the newest tokens whatever their gate.

    Attributes:
      window: the local band in tokens: the ring's slots per head.
      admits_at_most: tokens a head admits at most (local attention: its sinks); None: the
        prefill pool is first sized for `ADMITTED_GUESS` of the prompt.
    """

    window: int
    admits_at_most: int | None = None

    @property
    def local_window(self) -> int:
        return int(self.window)

    def admit(self, *, layer, k, v, positions, scores, thresholds):
        del layer, k, v, positions
        tau = thresholds[:, THRESHOLD_NAMES.index("tau")]
        return scores > tau[:, None, None]

    def prefill_pages(self, prompt_lengths, chunk, model_config, page_size, reserve) -> int:
        """A first guess (the pool grows as admission fills it): the admitted share, plus a
        chunk and `reserve` tokens per head; the global pages hold admitted tokens only (the
        ring is a side array)."""
        lengths = np.asarray(prompt_lengths)
        heads = model_config.num_layers * model_config.num_kv_heads
        if self.admits_at_most is None:
            guess = ADMITTED_GUESS * lengths
        else:
            guess = np.minimum(self.admits_at_most, lengths)
        per_head = np.ceil(guess / page_size) + -(-(chunk + reserve) // page_size) + 2
        return int(heads * per_head.sum())


@dataclasses.dataclass(frozen=True)
class LearnedWriteGate:
    """The gate part of WG-KV: each layer's learned write gate (`jaxkv.gates.wgkv`) on the
    token's keys before and after RoPE."""

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del h, positions, q, v
        return write_gate_values(layer_params, k_unrotated, k)


@dataclasses.dataclass(frozen=True)
class SinkGate:
    """The gate part of local attention: 1 for the first `sinks` positions, else 0."""

    sinks: int

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del layer_params, h, k_unrotated, q, v
        return _sink_gates(positions, self.sinks, k.shape[1]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class RetrievalHeadGate:
    """The gate part of DuoAttention: 1 for every token of a retrieval head (the layer's slice
    of bool [L, K] parameters), else as `SinkGate`."""

    sinks: int

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del h, k_unrotated, q, v
        sink = _sink_gates(positions, self.sinks, k.shape[1])
        return (sink | layer_params[None, :, None]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class RingAdmission(base.Policy):
    """The record of a `ThresholdAdmission` and a gate part (each subclass's), with tau.

    Attributes:
      tau: admission threshold in (0, 1); a token is promoted iff g > tau (strict). A
        threshold (`threshold_names`): jit sees it as an array, so a tau sweep compiles once.
      window: the local band in tokens (> 0): the ring's slots per head.
    """

    name: ClassVar[str] = "ring_admission"
    request_knobs: ClassVar[tuple[str, ...]] = THRESHOLD_NAMES
    tau: float | None = 0.1
    window: int = 256

    def _check(self) -> None:
        super()._check()
        if self.tau is not None:  # None: static(), tau travels in `thresholds`
            if isinstance(self.tau, bool) or not isinstance(self.tau, int | float):
                raise ValueError(f"tau={self.tau!r} must be a number in (0, 1)")
            if not 0.0 < self.tau < 1.0:
                raise ValueError(f"tau={self.tau} must be in (0, 1)")
        if isinstance(self.window, bool) or not isinstance(self.window, int | np.integer):
            raise ValueError(f"window={self.window!r} must be an integer > 0")
        if self.window <= 0:
            raise ValueError(f"window={self.window} must be > 0")

    def _parts(self) -> dict:
        values = None if self.tau is None else (self.tau,)
        return {
            "admission": ThresholdAdmission(self.window),
            "threshold_set": base.ThresholdSet(self.name, THRESHOLD_NAMES, values),
        }


# DuoAttention's retrieval heads when picked on a prompt: a quarter of all (layer, KV head) pairs.
DEFAULT_RETRIEVAL_SHARE = 0.25


def _sink_gates(positions: jax.Array, sinks: int, num_kv_heads: int) -> jax.Array:
    """f32 [B, K, C]: 1 for the first `sinks` positions, else 0."""
    sink = (positions >= 0) & (positions < sinks)
    return jnp.broadcast_to(
        sink[:, None, :], (positions.shape[0], num_kv_heads, positions.shape[1])
    )


def _check_sinks(sinks) -> None:
    if isinstance(sinks, bool) or not isinstance(sinks, int | np.integer) or sinks < 0:
        raise ValueError(f"sinks={sinks!r} must be an integer >= 0")


@base.register
@dataclasses.dataclass(frozen=True)
class WGKV(RingAdmission):
    """WG-KV: the learned write gate decides admission (policy_params: `jaxkv.gates.wgkv`)."""

    name: ClassVar[str] = "wgkv"
    primary_knob: ClassVar[str] = "tau"

    def _parts(self) -> dict:
        return super()._parts() | {"gate": LearnedWriteGate(), "params": WriteGateParams()}


@dataclasses.dataclass(frozen=True)
class WriteGateParams(base.LearnedParams):
    """WG-KV's learned write gates (`jaxkv.gates.wgkv`): a dict of [L, ...] arrays."""

    kind: ClassVar[str] = "wgkv"
    description: ClassVar[str] = (
        "write gates from jaxkv.gates.wgkv.init_write_gates or load_write_gates"
    )

    def init(self, model_config, key):
        return init_write_gates(model_config, key)

    def load(self, path, model_config):
        return load_write_gates(path, model_config)

    def check(self, params, model_config) -> None:
        check_write_gates(params, model_config)

    def axes(self, params):
        return {name: PARAM_AXES[name] for name in params}


@base.register
@dataclasses.dataclass(frozen=True)
class LocalAttention(RingAdmission):
    """Static admission: attention sinks (the first `sinks` positions) plus the sliding window.

    Attributes:
      sinks: leading positions admitted to the global cache.
    """

    name: ClassVar[str] = "local_attention"
    primary_knob: ClassVar[str] = "window"
    sinks: int = 4

    def _check(self) -> None:
        super()._check()
        _check_sinks(self.sinks)

    def _parts(self) -> dict:
        return super()._parts() | {
            "admission": ThresholdAdmission(self.window, admits_at_most=self.sinks),
            "gate": SinkGate(self.sinks),
        }


@base.register
@dataclasses.dataclass(frozen=True)
class DuoAttention(RingAdmission):
    """DuoAttention-style static admission: retrieval heads admit every token, streaming heads
    only the sinks (then read the window). policy_params: bool [L, K], True for retrieval heads
    (its `params` part, `RetrievalHeads`: saved ones or picked on the prompt itself).

    Attributes:
      sinks: leading positions every head admits.
      retrieval_share: the share of all (layer, KV head) pairs that heads picked on the prompt
        and untrained ones make retrieval heads, in [0, 1]; None: DEFAULT_RETRIEVAL_SHARE (saved
        heads refuse a share, which they would ignore).
    """

    name: ClassVar[str] = "duo_attention"
    # The share is host-side only (which heads are picked), so jit never sees it.
    request_knobs: ClassVar[tuple[str, ...]] = (*THRESHOLD_NAMES, "retrieval_share")
    sinks: int = 4
    retrieval_share: float | None = None

    def _check(self) -> None:
        super()._check()
        _check_sinks(self.sinks)
        share = self.retrieval_share
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1
        ):
            raise ValueError(f"retrieval_share={share!r} must be a number in [0, 1]")

    def _parts(self) -> dict:
        return super()._parts() | {
            "gate": RetrievalHeadGate(self.sinks),
            "params": RetrievalHeads(self.sinks, self.window, self.retrieval_share),
        }


@dataclasses.dataclass(frozen=True)
class RetrievalHeads(base.LearnedParams):
    """DuoAttention's retrieval heads: bool [L, K], True for a (layer, KV head) that admits
    every token; saved ones (`load`) or picked on the prompt itself (`from_prompt`).

    Attributes:
      sinks, window: the policy's sinks and local window (what a streaming head reads).
      retrieval_share: the share of (layer, KV head) pairs that `from_prompt` and `init` make
        retrieval heads; None: DEFAULT_RETRIEVAL_SHARE (saved heads refuse a share).
    """

    kind: ClassVar[str] = "duo_attention"
    description: ClassVar[str] = (
        "bool [L, K] retrieval heads (a .npy from `jaxkv train duo_attention`) or none to pick "
        "them on the prompt"
    )
    sinks: int
    window: int
    retrieval_share: float | None

    @property
    def share(self) -> float:
        return DEFAULT_RETRIEVAL_SHARE if self.retrieval_share is None else self.retrieval_share

    def init(self, model_config, key):
        """Untrained heads for planning: the first `share` of every layer's KV heads."""
        del key
        count = int(round(self.share * model_config.num_kv_heads))
        heads = np.zeros((model_config.num_layers, model_config.num_kv_heads), bool)
        heads[:, :count] = True
        return jnp.asarray(heads)

    def load(self, path, model_config):
        """A saved bool [L, K] array (.npy)."""
        if self.retrieval_share is not None:
            raise ValueError(
                f"retrieval_share={self.retrieval_share}: duo_attention reads its retrieval heads "
                f"from {path}; give one of the two"
            )
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"no DuoAttention heads at {path}: give a saved bool [L, K] .npy "
                "(`jaxkv train duo_attention` writes one)"
            )
        heads = np.load(path)
        self.check(heads, model_config)
        return heads

    def from_prompt(self, model, prompt_ids):
        """bool [L, K]: the `share` of (layer, KV head) pairs with the most long-range attention
        mass on the prompt itself (`long_range_attention_mass`, `retrieval_heads`). A prompt of
        at most sinks + 1 tokens has no long-range attention to measure: every head is a
        retrieval head (nothing is dropped, as for any prompt too short to compress)."""
        window = min(self.window, len(prompt_ids) - self.sinks - 1)
        if window < 1:
            cfg = model.config
            return jnp.ones((cfg.num_layers, cfg.num_kv_heads), bool)
        tokens = jnp.asarray([prompt_ids], jnp.int32)
        mass = long_range_attention_mass(model, tokens, sinks=self.sinks, window=window)
        return retrieval_heads(mass, self.share)

    def check(self, params, model_config) -> None:
        expected = (model_config.num_layers, model_config.num_kv_heads)
        shape = tuple(np.shape(params))
        if shape != expected:
            raise ValueError(
                f"policy 'duo_attention' needs policy_params of shape [L, K] = {expected} "
                f"(True for retrieval heads), got {shape}"
            )
        if jnp.result_type(params) != jnp.bool_:
            raise ValueError(f"duo_attention policy_params must be bool, got {params.dtype}")

    def axes(self, params):
        del params
        return ("layers", "kv_heads")


def retrieval_heads(scores, fraction: float) -> np.ndarray:
    """bool [L, K]: the `fraction` of all (layer, KV head) pairs with the highest calibration
    score (ties broken by index), as DuoAttention picks a global ratio of retrieval heads."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must be in [0, 1]")
    scores = np.asarray(scores, np.float64)
    count = int(round(fraction * scores.size))
    order = np.argsort(-scores.reshape(-1), kind="stable")
    chosen = np.zeros(scores.size, bool)
    chosen[order[:count]] = True
    return chosen.reshape(scores.shape)


def long_range_attention_mass(model, tokens, *, sinks: int, window: int) -> jax.Array:
    """DuoAttention calibration score f32 [L, K]: under full causal attention, the mean attention
    mass a query gives to keys a streaming head would not see (past the sinks and outside the
    band i - j < window), over queries at i >= sinks + window, averaged over the KV head's query
    heads. Heads that look far back score high.

    tokens int32 [B, T] with T > sinks + window (no padding).
    """
    t = tokens.shape[1]
    if t <= sinks + window:
        raise ValueError(f"calibration tokens T={t} must exceed sinks + window = {sinks + window}")
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    far = (j <= i) & (j >= sinks) & (i - j >= window)
    return attention_mass(model, tokens, far, np.arange(t) >= sinks + window)


@jax.jit
def attention_mass(model, tokens, keys, queries) -> jax.Array:
    """f32 [L, K]: under full causal attention, the attention mass each query puts on its `keys`,
    averaged over the `queries`, the batch and the KV head's query heads.

    tokens int32 [B, T] (no padding); keys bool [T, T] (query i, key j; only causal pairs count);
    queries bool [T], at least one True.
    """
    from jaxkv.models.decoder import attention_inputs, attention_output_and_mlp, embed, scan_layers
    from jaxkv.models.layers import rope_cos_sin

    cfg, params = model.config, model.params
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    cos, sin = rope_cos_sin(cfg, positions)
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    counted = causal & keys
    weights = queries.astype(jnp.float32)

    def layer(x, lp, _):
        q, k, v = attention_inputs(lp, cfg, x, cos, sin)
        probs = attention_ops.attention_probabilities(q, k, causal, cfg.head_dim**-0.5)
        mass = jnp.sum(jnp.where(counted, probs, 0.0), axis=-1)  # [B, N, T]
        mass = jnp.sum(mass * weights, axis=-1) / jnp.sum(weights)  # [B, N]
        per_kv_head = mass.reshape(mass.shape[0], cfg.num_kv_heads, -1).mean(axis=(0, 2))
        attn = jnp.einsum("bnts,bnsh->bnth", probs, jnp.repeat(v, cfg.group_size, axis=1))
        return attention_output_and_mlp(lp, cfg, x, attn), per_kv_head

    _, scores = scan_layers(layer, embed(params, tokens), params["layers"])
    return scores
