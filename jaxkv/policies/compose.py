"""Composition of policies as a field-by-field merge of their records: `compose(WGKV(...),
Quest(...))` admits with WG-KV's gates and lets Quest choose among the global pages (WG-KV's
local ring is read whole whatever Quest picks).

Every member of a policy belongs to one field of its record: a part (`jaxkv.step.parts.PARTS`,
and the learned parameters, `params`) or a host-side group (`HOST_GROUPS`: its budget, its
thresholds). A composition takes each field from the one policy that has it; the members every
policy answers together (`JOINT`: checks, flags, `static`, `for_tokenizer`) ask them all. Two
rules refuse a composition, each naming the field and both policies:

- a field in two policies (two gates, two budgets, ...): there is no merge of two of one kind;
  in particular a request carries one budget array, so a policy that compresses or evicts to a
  budget (StreamingLLM, H2O, SnapKV, ...) and Quest, whose budget is of pages read, cannot share
  a composition;
- two parts from different policies that the engine does not run together (`RUNS_TOGETHER`):
  an admission (and its gate) with a page selection is the one such pair today.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

from jaxkv.policies import base
from jaxkv.step import parts

# The record's parts: the engine's and the learned parameters (host side).
RECORD_PARTS = (*parts.PARTS, "params")
# A policy's host-side members, by the field of its record that answers them.
HOST_GROUPS = {
    "budget": ("budget_columns", "budget_tokens", "budget_ratio", "planned_tokens"),
    "thresholds": ("threshold_names", "thresholds", "threshold"),
}
# Members every policy of a composition answers (see `Composed`).
JOINT = ("check_prefill", "check_model", "decides_across_heads", "static", "for_tokenizer")
FIELDS = (*RECORD_PARTS, *HOST_GROUPS)
_WHY = {
    "budget": (
        " (a request carries one budget array, so a policy that keeps tokens to a budget and "
        "one that reads pages to a budget cannot share it)"
    )
}
# Pairs of parts, from different policies, that the engine runs together.
RUNS_TOGETHER = {frozenset(pair) for pair in (("admission", "selection"), ("gate", "selection"))}


def has_field(policy: base.Policy, field: str) -> bool:
    """Whether `policy` has the part `field`, or answers a host group other than as the base
    `Policy` does (a policy without a budget keeps its whole prompt)."""
    if field in RECORD_PARTS:
        return getattr(policy, field) is not None
    cls = type(policy)
    return any(
        getattr(cls, member) is not getattr(base.Policy, member) for member in HOST_GROUPS[field]
    )


def fields_of(policy: base.Policy) -> tuple[str, ...]:
    """The fields of `policy`'s record that it fills, in `FIELDS` order."""
    return tuple(field for field in FIELDS if has_field(policy, field))


@dataclasses.dataclass(frozen=True)
class Composed(base.Policy):
    """The record merged from `policies`: each field (`FIELDS`) from the one policy that has
    it; a field none has is answered as the base `Policy` does. Joint members: the prefill and
    the model are checked by all, the budget decides across heads if any policy's does.

    Attributes:
      policies: two or more policies (compositions among them are flattened).
    """

    name: ClassVar[str] = "composed"
    policies: tuple[base.Policy, ...]

    def __post_init__(self):
        super().__post_init__()
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
        for field in FIELDS:
            holders = [policy.name for policy in self.policies if has_field(policy, field)]
            if len(holders) > 1:
                article = "an" if field[0] in "aeiou" else "a"
                raise ValueError(
                    f"policies {holders[0]!r} and {holders[1]!r} both have {article} {field}: a "
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
                        "(WG-KV, DuoAttention, local attention) with a page selection (Quest)"
                    )

    def owner(self, field: str) -> base.Policy:
        """The policy that answers `field` (the first policy where none has it: it answers as
        the base does)."""
        for policy in self.policies:
            if has_field(policy, field):
                return policy
        return self.policies[0]

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


def _forwarded(field: str, member: str) -> property:
    return property(
        lambda self: getattr(self.owner(field), member),
        doc=f"`{member}` of the policy that has the {field}.",
    )


# Every part and host member is its owner's: one loop, so no member can be forgotten.
for _field in RECORD_PARTS:
    setattr(Composed, _field, _forwarded(_field, _field))
for _field, _members in HOST_GROUPS.items():
    for _member in _members:
        setattr(Composed, _member, _forwarded(_field, _member))


def compose(*policies: base.Policy) -> Composed:
    """One policy from the fields of `policies` (see the module docstring), e.g. `compose(
    WGKV(...), Quest(budget=64))`: WG-KV decides what is written, Quest which global pages
    each decode step reads."""
    return Composed(tuple(policies))
