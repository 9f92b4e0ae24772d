"""One prefill, several budgets (`jaxkv.prefill_at_budgets`) or policies (`jaxkv.prefill_each`):
each session keeps the tokens of its own prefill alone (and decodes its tokens, where decode
reads the budget); a policy whose prefill reads its budget, or policies whose forward passes
differ, are refused by name."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.gates import fastkvzip as fastkvzip_gates
from jaxkv.models import init_model
from tests.tiny_models import tiny_config

CONFIG = tiny_config()
BUDGETS = (0.75, 0.5, 0.125)
CHUNK = 64  # the 200-token prompt is read in four chunks


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


def _prompt() -> list[int]:
    return np.random.default_rng(0).integers(1, CONFIG.vocab_size, 200).tolist()


def _held(session) -> np.ndarray:
    """int [L, B, K, S]: the positions each head holds, sorted (-1s first)."""
    return np.sort(np.asarray(session.kv.positions()), axis=-1)


@pytest.mark.parametrize(
    "policy",
    [
        policies.get("snapkv", window=16),
        policies.get("adakv", inner=policies.get("snapkv", window=16)),
        policies.get("kvzip", repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6)),
        policies.get("streaming_llm", recent=16, evict_every=4),
        policies.get("chunkkv", inner=policies.get("snapkv", window=16)),  # a share threshold
    ],
    ids=lambda policy: policy.name,
)
def test_each_budget_keeps_and_decodes_as_its_own_prefill(model, policy):
    prompt = [_prompt()]
    shared = jaxkv.prefill_at_budgets(
        model, prompt, policy, BUDGETS, reserve_tokens=8, prefill_chunk=CHUNK
    )
    held = []
    for budget, session in zip(BUDGETS, shared, strict=True):
        alone = jaxkv.prefill(
            model,
            prompt,
            policies.base.with_budget(policy, budget),
            reserve_tokens=8,
            prefill_chunk=CHUNK,
        )
        np.testing.assert_array_equal(_held(session), _held(alone))
        if policy.decode_eviction is not None:  # its decode reads the session's budget
            np.testing.assert_array_equal(
                jaxkv.decode(session, 8, stop_tokens=[]).tokens,
                jaxkv.decode(alone, 8, stop_tokens=[]).tokens,
            )
        held.append(int(np.sum(_held(session) >= 0)))
    assert held[0] > held[1] > held[2]  # the budgets are each session's own


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("fastkvzip", dict(budget=0.4, window=8), "'fastkvzip' has chunk eviction"),
        ("wgkv", dict(window=8, tau=0.5), "'wgkv' has admission"),
    ],
)
def test_a_policy_whose_prefill_reads_its_budget_is_refused(model, name, options, match):
    params = fastkvzip_gates.init_params(CONFIG, jax.random.PRNGKey(4))
    with pytest.raises(ValueError, match=match):
        jaxkv.prefill_at_budgets(
            model, [_prompt()], policies.get(name, **options), BUDGETS, policy_params=params
        )


def test_no_budget_is_refused(model):
    with pytest.raises(ValueError, match="budgets is empty"):
        jaxkv.prefill_at_budgets(model, [_prompt()], "snapkv", [])


# Windows of 16, 8 and 1 queries, the attention input's moments (GVote), the pre-RoPE queries'
# moments from a position on (ExpectedAttention: not first, so it drives the prefill), KVzip's
# replay, no compression at all.
EACH = (
    policies.get("snapkv", budget=0.5, window=16),
    policies.get("expected_attention", budget=0.25),
    policies.get("tova", budget=0.5),
    policies.get("pyramidkv", budget=0.5, window=8),
    policies.get("gvote"),
    policies.get("kvzip", ratio=0.3, repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6)),
    policies.get("knorm", budget=0.125),
    policies.get("full"),
)


def test_each_policy_keeps_and_decodes_as_its_own_prefill(model):
    prompt = [_prompt()]
    shared = jaxkv.prefill_each(model, prompt, EACH, reserve_tokens=8, prefill_chunk=CHUNK)
    for policy, session in zip(EACH, shared, strict=True):
        alone = jaxkv.prefill(model, prompt, policy, reserve_tokens=8, prefill_chunk=CHUNK)
        np.testing.assert_array_equal(_held(session), _held(alone), err_msg=policy.name)
        np.testing.assert_array_equal(
            jaxkv.decode(session, 6, stop_tokens=[]).tokens,
            jaxkv.decode(alone, 6, stop_tokens=[]).tokens,
            err_msg=policy.name,
        )


@pytest.mark.parametrize(
    ("each", "match"),
    [
        ([policies.get("snapkv", budget=0.5), policies.get("h2o", budget=0.5)], "attention_scor"),
        ([policies.get("snapkv", budget=0.5), policies.get("wgkv", window=8)], "has admission"),
        ([], "policies is empty"),
    ],
)
def test_policies_whose_prefills_differ_are_refused(model, each, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.prefill_each(model, [_prompt()], each)


def test_one_params_entry_per_policy(model):
    with pytest.raises(ValueError, match="policy_params has 1 entries for 2 policies"):
        jaxkv.prefill_each(model, [_prompt()], ["snapkv:0.5", "tova:0.5"], policy_params=[None])
