"""Composition of an admission policy (what is written) with a page-selecting policy (what a
decode step reads): `compose(WGKV(...), Quest(...))` admits with WG-KV's gates and lets Quest
choose among the global pages; WG-KV's local ring is read whole whatever Quest picks.

A composition is a record of parts (`jaxkv.parts`) taken from its two policies: the admission
policy's `admission` and `gate`, the selection policy's `selection`. A policy with any other part
is refused by name, so a part cannot be silently dropped: the one budget a decode step is given
is the selection's read budget, which no prompt compression or eviction could share.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import numpy as np

from jaxkv import parts
from jaxkv.models.configs import ModelConfig
from jaxkv.policies import base
from jaxkv.policies.base import PolicyParams

# The parts each side of a composition may have; a composition has exactly these.
ADMITTING_PARTS = ("admission", "gate")
SELECTING_PARTS = ("selection",)
# Why a part cannot come along, for the error that refuses it.
_REFUSED = {
    "attention_scoring": "accumulates attention mass",
    "prompt_compression": "compresses the prompt after prefill with a budget of its own",
    "chunk_eviction": "evicts between prefill chunks with a budget of its own",
    "decode_eviction": "evicts during decode",
}


@dataclasses.dataclass(frozen=True)
class Composed(base.Policy):
    """Admission and gate from `admitting`, page selection and its read budget from
    `selecting`; host checks from both, learned parameters from `admitting`.

    Attributes:
      admitting: a policy whose parts are among `ADMITTING_PARTS` (WG-KV, DuoAttention).
      selecting: a policy whose parts are `SELECTING_PARTS` (Quest).
    """

    name: ClassVar[str] = "composed"
    admitting: base.Policy
    selecting: base.Policy

    def __post_init__(self):
        super().__post_init__()
        if self.selecting.selection is None:
            raise ValueError(f"selection={self.selecting.name!r} does not select pages")
        if self.admitting.selection is not None:
            raise ValueError(f"admission={self.admitting.name!r} already selects pages")
        if self.selecting.threshold_names:
            raise ValueError(f"selection={self.selecting.name!r} has thresholds of its own")
        sides = ((self.admitting, ADMITTING_PARTS), (self.selecting, SELECTING_PARTS))
        for policy, allowed in sides:
            refused = [_REFUSED[part] for part in parts.present(policy) if part not in allowed]
            if refused:
                raise ValueError(
                    f"policy {policy.name!r} {' and '.join(refused)}, which compose() does not "
                    "carry (the one budget is the selection's read budget); compose an "
                    "admission policy with a page selection policy"
                )

    @property
    def admission(self) -> parts.Admission | None:
        return self.admitting.admission

    @property
    def gate(self) -> parts.Gate | None:
        return self.admitting.gate

    @property
    def selection(self) -> parts.Selection:
        return self.selecting.selection

    @property
    def needs_params(self) -> bool:
        return self.admitting.needs_params

    @property
    def decides_across_heads(self) -> bool:
        return self.admitting.decides_across_heads or self.selecting.decides_across_heads

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        self.admitting.check_prefill(prompt_lengths, chunk)
        self.selecting.check_prefill(prompt_lengths, chunk)

    def budget_tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        return self.selecting.budget_tokens(prompt_lengths)

    def budget_ratio(self, batch: int) -> np.ndarray:
        return self.selecting.budget_ratio(batch)

    @property
    def threshold_names(self) -> tuple[str, ...]:
        """The admission's (the selection has none: `__post_init__`)."""
        return self.admitting.threshold_names

    def thresholds(self, batch: int) -> np.ndarray:
        return self.admitting.thresholds(batch)

    def threshold(self, thresholds, name: str):
        return self.admitting.threshold(thresholds, name)

    @property
    def params_kind(self) -> str | None:
        return self.admitting.params_kind

    def planned_tokens(self, budget_tokens, prompt_lengths) -> tuple[np.ndarray, str]:
        """What the admission holds (the selection keeps every token it is given)."""
        admitted_budget = self.admitting.budget_tokens(prompt_lengths)
        return self.admitting.planned_tokens(admitted_budget, prompt_lengths)

    def static(self) -> Composed:
        return Composed(admitting=self.admitting.static(), selecting=self.selecting.static())

    def for_tokenizer(self, tokenizer) -> Composed:
        return Composed(
            admitting=self.admitting.for_tokenizer(tokenizer),
            selecting=self.selecting.for_tokenizer(tokenizer),
        )

    def init_params(self, model_config: ModelConfig, key) -> PolicyParams | None:
        return self.admitting.init_params(model_config, key)

    def check_params(self, params: PolicyParams | None, model_config: ModelConfig) -> None:
        self.admitting.check_params(params, model_config)

    def shipped_params_path(self, model_name: str | None) -> Path | None:
        return self.admitting.shipped_params_path(model_name)

    def load_params(self, path, model_config: ModelConfig) -> PolicyParams:
        return self.admitting.load_params(path, model_config)

    def prompt_params(self, model, prompt_ids: list[int]) -> PolicyParams | None:
        return self.admitting.prompt_params(model, prompt_ids)

    def param_axes(self, params: PolicyParams | None) -> PolicyParams | None:
        return self.admitting.param_axes(params)


def compose(admission: base.Policy, selection: base.Policy) -> Composed:
    """`admission` decides what is written, `selection` which global pages each decode reads."""
    return Composed(admitting=admission, selecting=selection)
