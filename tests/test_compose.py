"""compose(*policies) as a union of records: every registered policy with Quest is either refused
with an error naming the field and the policies, or the composition keeps what the policy keeps,
in the pool it sizes, and reads as Quest does; each field of the record comes from the policy that
has it."""

import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.models import init_model
from jaxkv.policies.base import RECORD
from jaxkv.policies.compose import fields_of
from jaxkv.step import parts
from tests.test_sharding import CONFIG, POLICIES, POLICY_PARAMS, sharded_test_prompts

QUEST = policies.Quest(budget=16)
# What compose() accepts today; every other policy must be refused by name.
ACCEPTED = {"full", "wgkv", "local_attention", "duo_attention"}


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


def _kept(state) -> np.ndarray:
    return np.sort(np.asarray(state.positions()), axis=-1)


@pytest.mark.parametrize("name", sorted(set(policies.registered()) - {"quest"}))
def test_compose_refuses_or_keeps_what_its_admission_part_keeps(model, name):
    part = policies.get(name, **POLICIES[name])
    if name not in ACCEPTED:
        with pytest.raises(ValueError, match=f"'{name}'"):
            policies.compose(part, QUEST)
        return
    composed = policies.compose(part, QUEST)
    # Every part comes from the policy that has it: admission and gate from `part`, the
    # selection (and its budget) from Quest, and nothing else.
    for part_name in parts.PARTS:
        source = QUEST if part_name == "selection" else part
        assert getattr(composed, part_name) == getattr(source, part_name), part_name
    prompts = sharded_test_prompts()[:3]
    params = POLICY_PARAMS[name]() if name in POLICY_PARAMS else None
    alone = jaxkv.compress_prompt(model, prompts, part, policy_params=params)
    both = jaxkv.compress_prompt(model, prompts, composed, policy_params=params)
    np.testing.assert_array_equal(_kept(both), _kept(alone))
    assert both.pool.num_pages == alone.pool.num_pages
    lengths = np.array([len(p) for p in prompts])
    np.testing.assert_array_equal(composed.budget_tokens(lengths), QUEST.budget_tokens(lengths))

    # Decode: reading every page (Quest at ratio 1), the composition generates, keeps and
    # pools what the admission part alone does.
    def generate(policy):
        return jaxkv.generate(
            model, prompts, max_new_tokens=5, policy=policy, policy_params=params, stop_tokens=[]
        )

    alone, both = generate(part), generate(policies.compose(part, policies.Quest(budget=1.0)))
    np.testing.assert_array_equal(both.tokens, alone.tokens)
    np.testing.assert_array_equal(_kept(both.state), _kept(alone.state))
    assert both.state.pool.num_pages == alone.state.pool.num_pages
    assert generate(composed).tokens.shape == (3, 5)


def test_a_field_two_policies_have_is_refused_by_name():
    with pytest.raises(ValueError, match="'quest' and 'quest' both have a selection"):
        policies.compose(QUEST, QUEST)
    wgkv = policies.get("wgkv", **POLICIES["wgkv"])
    with pytest.raises(ValueError, match="'wgkv' and 'duo_attention' both have an admission"):
        policies.compose(wgkv, policies.get("duo_attention", **POLICIES["duo_attention"]), QUEST)
    # The stated rule for eviction with Quest: one budget array per request.
    with pytest.raises(ValueError, match="'streaming_llm' and 'quest' both have a budget.*one"):
        policies.compose(policies.StreamingLLM(budget=32), QUEST)
    with pytest.raises(ValueError, match="two or more policies, got 1"):
        policies.compose(QUEST)


def test_parts_the_engine_does_not_run_together_are_refused_by_name():
    wgkv = policies.get("wgkv", **POLICIES["wgkv"])
    with pytest.raises(ValueError, match="admission of policy 'wgkv' and the prompt_compression"):
        policies.compose(wgkv, policies.SnapKV(budget=8))


def test_compositions_flatten_and_a_policy_without_fields_adds_nothing():
    wgkv = policies.get("wgkv", **POLICIES["wgkv"])
    nested = policies.compose(policies.compose(wgkv, QUEST), policies.FullCache())
    assert nested.policies == (wgkv, QUEST, policies.FullCache())
    for field in RECORD:
        assert getattr(nested, field) == getattr(policies.compose(wgkv, QUEST), field), field
    assert nested.static() == policies.compose(wgkv.static(), QUEST.static(), policies.FullCache())
    lengths = np.array([40, 70])
    np.testing.assert_array_equal(nested.budget_tokens(lengths), QUEST.budget_tokens(lengths))
    np.testing.assert_array_equal(nested.thresholds(2), wgkv.thresholds(2))
    assert nested.params.kind == "wgkv"


def test_learned_parameters_are_checked_by_their_owner_the_others_see_none():
    wgkv = policies.get("wgkv", **POLICIES["wgkv"])
    composed = policies.compose(QUEST, wgkv)
    gates = POLICY_PARAMS["wgkv"]()
    composed.check_params(gates, CONFIG)  # Quest, checked with None, accepts
    with pytest.raises(ValueError, match="needs|policy_params"):
        composed.check_params(None, CONFIG)


@pytest.mark.parametrize("name", policies.registered())
def test_a_policy_fills_exactly_the_fields_whose_members_it_answers(name):
    policy = policies.get(name, **POLICIES[name])
    fields = fields_of(policy)
    assert set(parts.present(policy)) == set(fields) & set(parts.PARTS)
    assert ("threshold_set" in fields) == bool(policy.threshold_names)
    assert ("params" in fields) == (policy.params is not None)
    lengths = np.array([30, 50])
    if "budget_rule" not in fields:
        np.testing.assert_array_equal(policy.budget_tokens(lengths), lengths)
