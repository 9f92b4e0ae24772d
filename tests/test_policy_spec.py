"""`policies.from_spec`: the one text grammar of policies (the CLI and the benchmarks use it)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import cli, policies
from jaxkv.benchmarks import system
from jaxkv.policies import spec
from tests.tiny_models import tiny_config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("snapkv:0.25", policies.SnapKV(budget=0.25)),
        ("snapkv:256:window=32", policies.SnapKV(budget=256, window=32)),
        ("kvzip:30%", policies.get("kvzip", ratio=0.3)),
        ("fastkvzip:0.1:window=none", policies.get("fastkvzip", ratio=0.1, window=None)),
        ("wgkv:0.2:window=64", policies.WGKV(tau=0.2, window=64)),
        ("local_attention:32", policies.LocalAttention(window=32)),
        ("confkv:128:loose=256", policies.ConfKV(tight=128, loose=256)),
        ("confkv:tight=256:loose=512:pyramid=true", policies.ConfKV(256, 512, pyramid=True)),
        (" full ", policies.FullCache()),
        ("wgkv:0.3+quest:64", policies.compose(policies.WGKV(tau=0.3), policies.Quest(64))),
        ("per_layer:0.7,0.3:inner=keydiff", policies.PerLayer((0.7, 0.3), inner="keydiff")),
        ("kvzip:0.3:repeat_ids=5,6", policies.get("kvzip", ratio=0.3, repeat_ids=(5, 6))),
    ],
)
def test_specs_build_the_policy_the_keywords_build(text, expected):
    assert policies.from_spec(text) == expected


def test_every_policy_that_builds_from_defaults_builds_from_its_name():
    for name in policies.registered():
        try:
            expected = policies.get(name)
        except ValueError:  # it needs a budget: its name alone is the same error
            with pytest.raises(ValueError):
                policies.from_spec(name)
            continue
        assert policies.from_spec(name) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "give NAME"),
        ("nope:0.1", "registered policies are adakv"),
        ("full:0.3", "'full:0.3', value 0.3: policy 'full' takes no budget"),
        ("snapkv:0.3:0.2", "one VALUE may follow the name"),
        ("snapkv:window=3:0.2", "one VALUE may follow the name"),
        ("snapkv:windw=3", "'windw=3': give KEY=VALUE with KEY one of the fields"),
        ("snapkv:window=x", "window=x: expected int"),
        ("kvzip:256", "keeps a ratio of the prompt in \\(0, 1\\]"),
        ("snapkv:0", "give a ratio of the prompt in \\(0, 1\\]"),
        ("snapkv:1.5", "give a ratio of the prompt in \\(0, 1\\]"),
        ("confkv:64", "protected=64 must be smaller"),
        ("wgkv:0.3+", "give SPEC\\+SPEC with no empty part"),
        ("snapkv:0.3+quest:64", "'snapkv' and 'quest' both have a budget"),
        ("per_layer:0.7,x", "0.7,x: expected comma-separated numbers"),
        ("per_layer:0.7,1.5", "give each layer's share of the prompt kept, in \\(0, 1\\]"),
    ],
)
def test_bad_specs_name_the_part_and_what_is_allowed(text, match):
    with pytest.raises(ValueError, match=match):
        policies.from_spec(text)


def test_the_cli_and_the_system_benchmark_share_the_grammar():
    assert cli.policy_kwargs("snapkv", ["window=32"], "30%") == dict(window=32, budget=0.3)
    with pytest.raises(ValueError, match="--policy-arg 'w': give KEY=VALUE"):
        cli.policy_kwargs("snapkv", ["w"], None)
    for text in ("snapkv:0.25", "wgkv:0.5", "kvzip:0.3", "confkv:128:loose=256"):
        assert system.parse_policy(text) == policies.from_spec(text)
    with pytest.raises(SystemExit, match="KEY one of the fields of policy 'snapkv'"):
        system.parse_policy("snapkv:0.3:retrieval_share=0.5")
    config = tiny_config(num_kv_heads=4, num_heads=8, num_layers=3)
    policy, heads = system.build_policy("duo_attention:window=16:retrieval_share=0.5", config)
    assert policy.static() == policies.get("duo_attention", window=16).static()
    assert np.asarray(heads).sum(axis=1).tolist() == [2, 2, 2]
    assert spec.takes_ratio_only("kvzip") and not spec.takes_budget("gvote")


def test_generate_and_compress_prompt_take_a_spec():
    import jaxkv
    from jaxkv.models import init_model
    from tests.tiny_models import tiny_config

    model = init_model(tiny_config(), seed=0, scale=0.3)
    prompts = [list(range(3, 60)), list(range(5, 40))]
    by_text = jaxkv.generate(model, prompts, max_new_tokens=4, policy="snapkv:0.5:window=8")
    by_object = jaxkv.generate(
        model, prompts, max_new_tokens=4, policy=policies.SnapKV(budget=0.5, window=8)
    )
    assert (by_text.tokens == by_object.tokens).all()
    assert (by_text.memory_bytes == by_object.memory_bytes).all()
    state = jaxkv.compress_prompt(model, prompts, "streaming_llm:16")
    assert int(state.lengths.max()) == 16
    with pytest.raises(ValueError, match="must be a jaxkv.policies.Policy or a spec"):
        jaxkv.generate(model, prompts, max_new_tokens=1, policy=0.3)
