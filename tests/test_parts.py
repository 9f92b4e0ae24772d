"""Every registered policy is a record of parts (`jaxkv.step.parts`, `policies.base.RECORD`): each
part it has satisfies its protocol, it has the parts its method needs, no more, no part holds a
policy, and every member of a policy is a field or the base's answer from its fields."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv import policies
from jaxkv.policies.scissorhands import UnimportanceCount
from jaxkv.step import parts
from tests.test_sharding import CONFIG, POLICIES

# The parts each registered policy has, from its paper (and kvpress's press of the same name).
EXPECTED = {
    "full": (),
    "streaming_llm": ("prompt_compression", "decode_eviction"),
    "sliding_window": ("prompt_compression", "decode_eviction"),
    "snapkv": ("prompt_compression",),
    "pyramidkv": ("prompt_compression",),
    "tova": ("prompt_compression",),
    "knorm": ("prompt_compression",),
    "expected_attention": ("prompt_compression",),
    "observed_attention": ("attention_scoring", "prompt_compression"),
    "adakv": ("prompt_compression",),  # with SnapKV inside; with H2O it scores attention
    "h2o": ("attention_scoring", "prompt_compression", "decode_eviction"),
    "scissorhands": ("attention_scoring", "prompt_compression", "decode_eviction"),
    "sage_kv": ("prompt_compression", "decode_eviction"),
    "gvote": ("prompt_compression",),
    "kvzip": ("prompt_compression",),
    "confkv": ("attention_scoring", "prompt_compression", "decode_eviction"),
    "fastkvzip": ("gate", "chunk_eviction", "decode_eviction"),
    "quest": ("selection",),
    "wgkv": ("admission", "gate"),
    "local_attention": ("admission", "gate"),
    "duo_attention": ("admission", "gate"),
    "keydiff": ("prompt_compression",),
    "lagkv": ("prompt_compression",),
    "cur": ("prompt_compression",),
    "random": ("prompt_compression",),
    "chunkkv": ("prompt_compression",),
    "chunk": ("prompt_compression",),
    "block": ("prompt_compression",),
    "criticalkv": ("prompt_compression",),
    "critical_adakv": ("prompt_compression",),
    "decoding": ("decode_eviction",),
    "cam": ("attention_scoring", "decode_eviction"),
    "ratio_decoding": ("decode_eviction",),
    "per_layer": ("prompt_compression",),
    "dms": ("prompt_compression",),
    "simlayerkv": ("prompt_compression",),
    "think": ("prompt_compression",),
    "key_rerotation": ("prompt_compression",),
    "merging": ("prompt_compression",),
    "finch": ("prompt_compression",),
    "entropy_chunkkv": ("prompt_compression",),
    "cap": ("prompt_compression",),  # with decoding=True, a decode eviction too
    "kvcompose": ("prompt_compression",),
    "kvgrad": ("prompt_compression",),
    "lukv": ("prompt_compression",),
    "noncausal_attention": ("gate", "prompt_compression"),
    "compactor": ("gate", "prompt_compression"),
    "qfilter": ("gate", "prompt_compression"),
    "expected_attention_stats": ("prompt_compression",),
    "leverage": ("prompt_compression",),
    "kvzap": ("gate", "prompt_compression"),
}


def test_every_registered_policy_is_listed():
    assert sorted(EXPECTED) == policies.registered()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parts_are_those_of_the_method_and_satisfy_their_protocols(name):
    policy = policies.get(name, **POLICIES.get(name, {}))
    assert parts.present(policy) == EXPECTED[name]
    assert parts.present(policy.static()) == EXPECTED[name]
    for part in EXPECTED[name]:
        assert isinstance(getattr(policy, part), parts.PROTOCOLS[part]), part


def test_adakv_wraps_its_inner_scorer_s_compression_and_keeps_every_other_part():
    inner = policies.Scissorhands(budget=0.5, sinks=2, recent=3)
    ada = policies.AdaKV(budget=0.5, inner=inner, recent=5, safeguard=0.3)
    for part in set(parts.PARTS) - {"prompt_compression"}:
        assert getattr(ada, part) == getattr(inner, part), part
    # Scissorhands' own counting rule, not a sum; its compression's score reset too.
    assert isinstance(ada.attention_scoring, UnimportanceCount)
    assert ada.prompt_compression == dataclasses.replace(
        inner.prompt_compression, protected_recent=5, safeguard=0.3
    )
    assert policies.AdaKV(budget=0.5, inner="knorm").attention_scoring is None
    with pytest.raises(ValueError, match="inner='sage_kv' must be a scoring eviction policy"):
        policies.AdaKV(budget=0.5, inner="sage_kv")


# Every policy with parts: each part an object of its own, of one idea.
NARROW = tuple(sorted(set(EXPECTED) - {"full"}))


def _public_members(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


@pytest.mark.parametrize("name", NARROW)
def test_a_narrow_policy_s_parts_answer_their_protocol_and_nothing_else(name):
    policy = policies.get(name, **POLICIES.get(name, {}))
    for part in parts.present(policy):
        obj = getattr(policy, part)
        assert obj is not policy, part
        protocol = _public_members(parts.PROTOCOLS[part])
        fields = {field.name for field in dataclasses.fields(obj)}
        assert _public_members(obj) - fields == protocol, part


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_budget_has_one_column_per_named_column(name):
    """`budget_tokens` is [B] for one budget, else [B, n] with `budget_columns` naming the n
    columns, which the parts read by name (`parts.budget_column`)."""
    policy = policies.get(name, **POLICIES.get(name, {}))
    budget = policy.budget_tokens(np.array([300, 400]))
    columns = policy.budget_columns
    assert budget.shape == ((2, len(columns)) if columns else (2,))
    for index, column in enumerate(columns):
        by_name = parts.budget_column(budget, columns, column)
        np.testing.assert_array_equal(by_name, budget[:, index])


def test_named_budget_columns_of_confkv_and_fastkvzip():
    confkv = policies.ConfKV(tight=64, loose=128, tau=0.5, protected=8)
    budget = confkv.budget_tokens(np.array([300]))
    assert confkv.budget_columns == ("tight", "loose")
    assert parts.budget_column(budget, confkv.budget_columns, "loose")[0] == 128
    fastkvzip = policies.FastKVzip(ratio=0.25, window=16, decode_tokens=40)
    budget = fastkvzip.budget_tokens(np.array([400]))
    named = dict(zip(fastkvzip.budget_columns, budget[0], strict=True))
    assert named == {"kept": 100, "window": 16, "decode": 40}


# The policies with a learned-parameters part (`Policy.params`), each of the kind of its name.
LEARNED = {
    "wgkv",
    "fastkvzip",
    "duo_attention",
    "qfilter",
    "expected_attention_stats",
    "kvzap",
    "lukv",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_params_part_makes_checks_and_places_its_own_parameters(name):
    """The params part is one object: its fresh parameters pass its check and the policy's,
    their axes name every leaf's dimensions, and a policy without one refuses parameters."""
    policy = policies.get(name, **POLICIES.get(name, {}))
    part = policy.params
    if name not in LEARNED:
        assert part is None
        policy.check_params(None, CONFIG)
        with pytest.raises(ValueError, match=f"policy {name!r} takes no policy_params"):
            policy.check_params(np.zeros((CONFIG.num_layers,)), CONFIG)
        return
    assert isinstance(part, policies.LearnedParams) and part.kind == name
    params = part.init(CONFIG, jax.random.PRNGKey(0))
    part.check(params, CONFIG)
    policy.check_params(params, CONFIG)
    with pytest.raises(ValueError, match=f"policy {name!r} needs policy_params: "):
        policy.check_params(None, CONFIG)
    axes = part.axes(params)
    leaves = jax.tree.leaves(params)
    axes_leaves = jax.tree.leaves(axes, is_leaf=lambda node: isinstance(node, tuple))
    assert [len(a) for a in axes_leaves] == [np.ndim(leaf) for leaf in leaves]
    assert all(a[0] == "layers" for a in axes_leaves)
    assert part.shipped_path("no-such-model") is None
    assert policy.static().params.kind == part.kind


# The public members of `Policy` that are not fields: class constants, and the host's answers
# from the record's fields (the budget and threshold parts, the params part's check) or from
# the settings (`static`, checks a policy may add to).
CONSTANTS = {"name", "primary_knob", "decides_across_heads", "request_knobs"}
ANSWERS = {
    "budget_columns",
    "budget_tokens",
    "budget_ratio",
    "prompt_share",
    "planned_tokens",
    "threshold_names",
    "thresholds",
    "static",
    "check_prefill",
    "for_tokenizer",
    "check_params",
    "check_model",
}


def _record_policies():
    yield from (policies.get(name, **POLICIES.get(name, {})) for name in sorted(EXPECTED))
    wgkv = policies.get("wgkv", **POLICIES["wgkv"])
    yield policies.compose(wgkv, policies.Quest(budget=16))
    yield policies.AdaKV(budget=0.5, inner=policies.H2O(budget=0.5))


def test_the_base_policy_is_its_record_and_answers_from_it():
    fields = {field.name for field in dataclasses.fields(policies.Policy)}
    assert fields == set(policies.base.RECORD)
    members = _public_members(policies.Policy)
    assert members == fields | CONSTANTS | ANSWERS


@pytest.mark.parametrize("policy", list(_record_policies()), ids=lambda p: p.name)
def test_a_policy_s_members_are_its_fields_and_the_base_s_answers(policy):
    settings = {field.name for field in dataclasses.fields(policy)}
    assert _public_members(policy) - settings <= _public_members(policies.Policy)


def _policies_inside(value, path: str):
    """(path, policy) for every Policy reachable from `value` through dataclass fields and
    tuples (a part's scorer, ranking, ...)."""
    if isinstance(value, policies.Policy):
        yield path, value
        return
    if isinstance(value, tuple):
        for index, item in enumerate(value):
            yield from _policies_inside(item, f"{path}[{index}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _policies_inside(getattr(value, field.name), f"{path}.{field.name}")


@pytest.mark.parametrize("policy", list(_record_policies()), ids=lambda p: p.name)
def test_no_part_holds_a_policy_and_parts_follow_from_the_settings(policy):
    for field in policies.base.RECORD:
        part = getattr(policy, field)
        assert list(_policies_inside(part, field)) == [], field
    # Built again from equal settings, the record is equal: parts are the settings' function.
    again = dataclasses.replace(policy)
    for field in policies.base.RECORD:
        assert getattr(again, field) == getattr(policy, field), field
    static = policy.static()
    for field in policies.base.RECORD:
        assert (getattr(static, field) is None) == (getattr(policy, field) is None), field
