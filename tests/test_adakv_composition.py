"""AdaKV wraps its inner scorer's prompt compression and keeps every other part of it: the inner
policy's sinks stay protected and its decode eviction runs (both were dropped before)."""

import numpy as np
import pytest

import jaxkv
from jaxkv import bundled, policies, prose
from jaxkv.models import load_hf_checkpoint
from jaxkv.step import parts

PROMPT = list(" ".join(prose.paragraphs()[:2]).encode()[:300])


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


def test_adakv_over_streaming_llm_keeps_the_sinks(model):
    alone = jaxkv.compress_prompt(model, [PROMPT], policies.get("streaming_llm", budget=64))
    ada = jaxkv.compress_prompt(
        model, [PROMPT], policies.get("adakv", budget=64, inner="streaming_llm")
    )
    for kv in (alone, ada):
        kept = set(np.asarray(kv.positions(0))[0, 0].tolist())
        assert {0, 1, 2, 3} <= kept


@pytest.mark.parametrize("inner", ["h2o", "streaming_llm"])
def test_adakv_runs_its_inner_policy_s_decode_eviction(model, inner):
    steps = 40
    alone = policies.get(inner, budget=64, evict_every=8)
    ada = policies.get("adakv", budget=64, inner=policies.get(inner, evict_every=8))
    assert ada.decode_eviction is not None
    assert parts.present(ada) == parts.present(alone)
    held = {}
    for name, policy in (("alone", alone), ("ada", ada)):
        out = jaxkv.generate(model, [PROMPT], max_new_tokens=steps, policy=policy, stop_tokens=())
        held[name] = np.asarray(out.state.lengths).mean()
    # Without decode eviction AdaKV would hold 64 + 39 tokens per head on average.
    assert held["ada"] <= 64 + 8
    assert held["ada"] == pytest.approx(held["alone"], abs=8)
