"""Every registered policy is a record of parts (`jaxkv.parts`): each part it has satisfies its
protocol, and it has the parts its method needs, no more."""

import dataclasses

import pytest

from jaxkv import parts, policies
from tests.test_sharding import POLICIES

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


def test_an_inner_scorer_brings_its_attention_scoring_to_adakv():
    ada = policies.AdaKV(budget=0.5, inner=policies.Scissorhands())
    assert ada.attention_scoring is ada.inner  # Scissorhands' own counting rule, not a sum
    assert policies.AdaKV(budget=0.5, inner="knorm").attention_scoring is None


# Policies whose parts are objects of their own, each of one idea (the others fill their parts
# with themselves, for now).
NARROW = ("fastkvzip", "wgkv", "local_attention", "duo_attention")


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
