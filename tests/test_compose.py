"""compose(admission, selection) for every registered policy as the admission part and Quest as
the selection: either refused with an error naming the part, or the composition keeps what the
part keeps, in the pool the part sizes, and reads as Quest does."""

import numpy as np
import pytest

import jaxkv
from jaxkv import parts, policies
from jaxkv.models import init_model
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
        with pytest.raises(ValueError, match=f"policy '{name}'"):
            policies.compose(part, QUEST)
        return
    composed = policies.compose(part, QUEST)
    # Every part comes from the policy that has it: admission and gate from `part`, the
    # selection from Quest, and nothing else.
    for part_name in parts.PARTS:
        source = QUEST if part_name == "selection" else part
        assert getattr(composed, part_name) is getattr(source, part_name), part_name
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


def test_quest_is_refused_as_the_admission_part_and_others_as_the_selection():
    with pytest.raises(ValueError, match="admission='quest' already selects pages"):
        policies.compose(QUEST, QUEST)
    with pytest.raises(ValueError, match="selection='full' does not select pages"):
        policies.compose(policies.FullCache(), policies.FullCache())


def test_composed_answers_every_host_question_of_a_policy_itself():
    """A composition forwards every member of the policy record besides its class constants:
    a member added to `Policy` and forgotten here would silently give the base's answer."""
    constants = {"name", "primary_knob"}
    members = {
        name for name in dir(policies.Policy) if not name.startswith("_") and name not in constants
    }
    missing = sorted(members - set(vars(policies.Composed)) - set(parts.PARTS))
    assert not missing, f"Composed does not forward {missing}"
    assert {"admission", "gate", "selection"} <= set(vars(policies.Composed))
