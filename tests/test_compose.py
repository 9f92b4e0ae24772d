"""compose(admission, selection) for every registered policy as the admission part and Quest as
the selection: either refused with an error naming the part, or the composition keeps what the
part keeps, in the pool the part sizes, and reads as Quest does."""

import numpy as np
import pytest

import jaxkv
from jaxkv import policies
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
    assert composed.selects_pages and not composed.evicts_during_decode
    assert (composed.local_window, composed.prefill_pool_grows) == (
        part.local_window,
        part.prefill_pool_grows,
    )
    prompts = sharded_test_prompts()[:3]
    params = POLICY_PARAMS[name]() if name in POLICY_PARAMS else None
    alone = jaxkv.compress_prompt(model, prompts, part, policy_params=params)
    both = jaxkv.compress_prompt(model, prompts, composed, policy_params=params)
    np.testing.assert_array_equal(_kept(both), _kept(alone))
    assert both.pool.num_pages == alone.pool.num_pages
    lengths = np.array([len(p) for p in prompts])
    np.testing.assert_array_equal(composed.budget_tokens(lengths), QUEST.budget_tokens(lengths))
    out = jaxkv.generate(
        model, prompts, max_new_tokens=3, policy=composed, policy_params=params, stop_tokens=[]
    )
    assert out.tokens.shape == (3, 3)


def test_quest_is_refused_as_the_admission_part_and_others_as_the_selection():
    with pytest.raises(ValueError, match="admission='quest' already selects pages"):
        policies.compose(QUEST, QUEST)
    with pytest.raises(ValueError, match="selection='full' does not select pages"):
        policies.compose(policies.FullCache(), policies.FullCache())
