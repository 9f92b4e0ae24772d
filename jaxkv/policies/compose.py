"""Composition of an admission policy (what is written) with a page-selecting policy (what a
decode step reads): `compose(WGKV(...), Quest(...))` admits with WG-KV's gates and lets Quest
choose among the global pages; WG-KV's local ring is read whole whatever Quest picks."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from jaxkv.cache import KVState, PagePool
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model
from jaxkv.policies import base
from jaxkv.policies.base import PolicyParams


@dataclasses.dataclass(frozen=True)
class Composed(base.Policy):
    """Admission hooks (write_scores, admit, local ring, params, the prefill pool's geometry)
    from `admission`; page selection and its read budget from `selection`; compress/on_decode
    run admission's then selection's. Neither part may evict during decode: the one budget a
    decode step is given is the selection's read budget.

    Attributes:
      admission: a policy that decides writes and does not select pages.
      selection: a policy that selects pages (Quest).
    """

    name: ClassVar[str] = "composed"
    selects_pages: ClassVar[bool] = True
    admission: base.Policy
    selection: base.Policy

    def __post_init__(self):
        super().__post_init__()
        if not self.selection.selects_pages:
            raise ValueError(f"selection={self.selection.name!r} does not select pages")
        if self.admission.selects_pages:
            raise ValueError(f"admission={self.admission.name!r} already selects pages")
        for part in (self.admission, self.selection):
            if part.accumulates_attention or part.needs_input_stats or part.observation_window:
                raise ValueError(
                    f"policy {part.name!r} records prefill statistics, which compose() does not "
                    "forward; compose an admission policy with a page selection policy"
                )
            if part.evicts_during_decode:
                raise ValueError(
                    f"policy {part.name!r} evicts during decode, which compose() does not run "
                    "(the decode budget is the selection's read budget); compose an admission "
                    "policy with a page selection policy"
                )
            if _compresses_the_prompt(part):
                raise ValueError(
                    f"policy {part.name!r} compresses the prompt after prefill with a budget "
                    "of its own, which compose() does not carry (the one budget is the "
                    "selection's read budget); compose an admission policy with a page "
                    "selection policy"
                )

    @property
    def label(self) -> str:
        return f"{self.admission.name}+{self.selection.name}"

    @property
    def needs_params(self) -> bool:
        return self.admission.needs_params

    @property
    def local_window(self) -> int:
        return self.admission.local_window

    @property
    def prefill_pool_grows(self) -> bool:
        return self.admission.prefill_pool_grows

    def prefill_pages(self, *args: Any) -> int | None:
        return self.admission.prefill_pages(*args)

    def prefill_chunk(self, prompt_lengths: np.ndarray, default: int) -> int:
        return self.admission.prefill_chunk(prompt_lengths, default)

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        self.admission.check_prefill(prompt_lengths, chunk)
        self.selection.check_prefill(prompt_lengths, chunk)

    def after_prefill_chunk(self, kv: KVState, **kwargs: Any) -> KVState:
        return self.admission.after_prefill_chunk(kv, **kwargs)

    def budget_tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        return self.selection.budget_tokens(prompt_lengths)

    def static(self) -> Composed:
        return Composed(admission=self.admission.static(), selection=self.selection.static())

    def check_params(self, params: PolicyParams | None, model_config: ModelConfig) -> None:
        self.admission.check_params(params, model_config)

    def load_params(self, path, model_config: ModelConfig) -> PolicyParams:
        return self.admission.load_params(path, model_config)

    def param_axes(self, params: PolicyParams | None) -> PolicyParams | None:
        return self.admission.param_axes(params)

    def write_scores(self, layer_params: PolicyParams | None, **kwargs: Any) -> jax.Array | None:
        return self.admission.write_scores(layer_params, **kwargs)

    def admit(self, **kwargs: Any) -> jax.Array | None:
        return self.admission.admit(**kwargs)

    def select_pages(
        self,
        q: jax.Array,
        pool: PagePool,
        page_table: jax.Array,
        lengths: jax.Array,
        read_budget: jax.Array,
    ) -> jax.Array:
        return self.selection.select_pages(q, pool, page_table, lengths, read_budget)

    def compress(self, kv: KVState, obs: base.PrefillObservations, model: Model) -> KVState:
        return self.selection.compress(self.admission.compress(kv, obs, model), obs, model)

    def on_decode(self, kv: KVState, ctx: base.DecodeContext) -> KVState:
        return self.selection.on_decode(self.admission.on_decode(kv, ctx), ctx)


def _compresses_the_prompt(policy: base.Policy) -> bool:
    """Whether the policy evicts between prefill chunks or after prefill (its own hooks)."""
    return (
        any(
            getattr(type(policy), hook) is not getattr(base.Policy, hook)
            for hook in ("compress", "after_prefill_chunk")
        )
        or policy.needs_prompt_tokens
    )


def compose(admission: base.Policy, selection: base.Policy) -> Composed:
    """`admission` decides what is written, `selection` which global pages each decode reads."""
    return Composed(admission=admission, selection=selection)
