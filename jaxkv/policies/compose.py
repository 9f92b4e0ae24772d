"""Composition of policies as a union of their records: `compose(WGKV(...), Quest(...))` admits
with WG-KV's gates and lets Quest choose among the global pages (WG-KV's local ring is read whole
whatever Quest picks).

A policy is a record of parts (`base.RECORD`: the engine's parts, its learned parameters, its
budget and its thresholds), None where it has none; a composition takes each field from the one
policy that has it, and asks them all what every policy answers together (the prefill and model
checks, whether a budget decides across heads, `static`, `for_tokenizer`). Two rules refuse a
composition, each naming the field and both policies:

- a field in two policies (two gates, two budgets, ...): there is no merge of two of one kind;
  in particular a request carries one budget array, so a policy that compresses or evicts to a
  budget (StreamingLLM, H2O, SnapKV, ...) and Quest, whose budget is of pages read, cannot share
  a composition;
- two parts from different policies that the engine does not run together (`RUNS_TOGETHER`):
  an admission (and its gate) with a page selection, and a prompt compression with a decode
  eviction (kvpress's PrefillDecodingPress: `knorm:0.5+decoding:256`), are the pairs today.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

from jaxkv.policies import base
from jaxkv.step import parts

_WHY = {
    "budget_rule": (
        " (a request carries one budget array, so a policy that keeps tokens to a budget and "
        "one that reads pages to a budget cannot share it)"
    )
}
# How an error names a field that is not a part's name.
_NOUNS = {"params": "parameter set", "budget_rule": "budget", "threshold_set": "threshold set"}
# Pairs of parts, from different policies, that the engine runs together.
RUNS_TOGETHER = {
    frozenset(pair)
    for pair in (
        ("admission", "selection"),
        ("gate", "selection"),
        ("prompt_compression", "decode_eviction"),
    )
}


def fields_of(policy: base.Policy) -> tuple[str, ...]:
    """The fields of `policy`'s record that it fills, in `base.RECORD` order."""
    return tuple(field for field in base.RECORD if getattr(policy, field) is not None)


@dataclasses.dataclass(frozen=True)
class Composed(base.Policy):
    """The record whose every field (`base.RECORD`) is the one of the policy that has it, None
    where none has. Joint members: the prefill and the model are checked by all, the budget
    decides across heads if any policy's does.

    Attributes:
      policies: two or more policies (compositions among them are flattened).
    """

    name: ClassVar[str] = "composed"
    policies: tuple[base.Policy, ...]

    def _check(self) -> None:
        super()._check()
        flat = tuple(
            leaf
            for policy in self.policies
            for leaf in (policy.policies if isinstance(policy, Composed) else (policy,))
        )
        object.__setattr__(self, "policies", flat)
        if len(flat) < 2:
            raise ValueError(f"compose() takes two or more policies, got {len(flat)}")
        for policy in flat:
            if not isinstance(policy, base.Policy):
                raise ValueError(f"compose() takes policies, got {policy!r}")
        self._check_fields()
        self._check_runs_together()

    def _check_fields(self) -> None:
        for field in base.RECORD:
            holders = [p.name for p in self.policies if getattr(p, field) is not None]
            if len(holders) > 1:
                noun = _NOUNS.get(field, field)
                article = "an" if noun[0] in "aeiou" else "a"
                raise ValueError(
                    f"policies {holders[0]!r} and {holders[1]!r} both have {article} {noun}: a "
                    "composition takes each part, budget, threshold set and parameter set from "
                    f"one policy{_WHY.get(field, '')}"
                )

    def _check_runs_together(self) -> None:
        for first, second in itertools.combinations(self.policies, 2):
            for a, b in itertools.product(parts.present(first), parts.present(second)):
                if frozenset((a, b)) not in RUNS_TOGETHER:
                    raise ValueError(
                        f"the {a} of policy {first.name!r} and the {b} of policy "
                        f"{second.name!r} do not run together: compose an admission policy "
                        "(WG-KV, DuoAttention, local attention) with a page selection (Quest), "
                        "or a prompt compression with a decode eviction (decoding)"
                    )

    def _parts(self) -> dict:
        held = (
            (field, getattr(policy, field)) for policy in self.policies for field in base.RECORD
        )
        return {field: part for field, part in held if part is not None}

    @property
    def decides_across_heads(self) -> bool:
        return any(policy.decides_across_heads for policy in self.policies)

    def check_prefill(self, prompt_lengths, chunk: int) -> None:
        for policy in self.policies:
            policy.check_prefill(prompt_lengths, chunk)

    def check_model(self, model_config) -> None:
        for policy in self.policies:
            policy.check_model(model_config)

    def static(self) -> Composed:
        return Composed(tuple(policy.static() for policy in self.policies))

    def for_tokenizer(self, tokenizer) -> Composed:
        return Composed(tuple(policy.for_tokenizer(tokenizer) for policy in self.policies))


def compose(*policies: base.Policy) -> Composed:
    """One policy from the fields of `policies` (see the module docstring), e.g. `compose(
    WGKV(...), Quest(budget=64))`: WG-KV decides what is written, Quest which global pages
    each decode step reads."""
    return Composed(tuple(policies))
