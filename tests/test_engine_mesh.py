"""The engine on a (data, model) mesh of 8 host CPU devices: each data shard a lane with its own
slots, prefill rows and a pool per device, KV heads over the model axis; tokens equal one
device's (`generate`'s), preempted requests swapped out and back included.

The model is `test_sharding`'s Llama-shaped tiny model (4 KV heads, 8 query heads, MLP 128,
f32), so that the model axis splits heads 4 ways."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv import CacheConfig, policies, sharding
from jaxkv.engine import Engine
from jaxkv.gates import fastkvzip as fastkvzip_gates
from jaxkv.gates import wgkv as wgkv_gates
from jaxkv.models import init_model
from tests.test_engine import reference
from tests.test_sharding import CONFIG

PROMPTS = [
    list(np.random.default_rng(0).integers(0, CONFIG.vocab_size, n)) for n in (150, 97, 131, 120)
]

POLICIES = {
    "full": lambda: (policies.get("full"), None),
    "snapkv": lambda: (policies.get("snapkv", budget=0.3), None),
    "h2o": lambda: (policies.get("h2o", budget=0.3), None),
    "kvzip": lambda: (
        policies.get("kvzip", budget=0.3, repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6)),
        None,
    ),
    "fastkvzip": lambda: (
        policies.get("fastkvzip", budget=0.4, window=8, decode_buffer=4),
        fastkvzip_gates.init_params(CONFIG, jax.random.PRNGKey(4)),
    ),
    "wgkv": lambda: (
        policies.get("wgkv"),
        wgkv_gates.init_write_gates(CONFIG, jax.random.PRNGKey(3)),
    ),
}


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_engine_on_a_2x4_mesh_gives_one_device_s_tokens(model, name):
    """Two lanes of two slots and one prefill row each, four KV heads over four devices: four
    requests queue, prefill a chunk at a time in their lane and decode side by side."""
    policy, params = POLICIES[name]()
    options = dict(policy_params=params, prefill_chunk=64)
    mesh = sharding.make_inference_mesh(data=2, model=4)
    eng = Engine(
        model,
        policy,
        cache=CacheConfig(num_pages=128),
        max_slots=4,
        max_prefills=2,
        max_context=512,
        mesh=mesh,
        policy_params=params,
        prefill_chunk=64,
    )
    ids = {eng.submit(prompt, max_new_tokens=8): i for i, prompt in enumerate(PROMPTS)}
    tokens = eng.run()
    assert eng.stats()["pages_in_use"] == 0
    for request, index in ids.items():
        assert tokens[request] == reference(model, policy, PROMPTS[index], 8, **options), index


def test_a_full_lane_swaps_a_request_out_and_it_comes_back_whole(model):
    """Short prompts and long answers on 40 pages a device: the lanes run dry, requests are
    swapped out to the host and back (into any lane), tokens equal one device's."""
    mesh = sharding.make_inference_mesh(data=2, model=4)
    eng = Engine(
        model,
        "full",
        cache=CacheConfig(num_pages=40),
        max_slots=4,
        max_prefills=2,
        max_context=512,
        mesh=mesh,
        prefill_chunk=64,
    )
    rng = np.random.default_rng(1)
    short = [list(rng.integers(0, CONFIG.vocab_size, 40)) for _ in range(6)]
    ids = {eng.submit(prompt, max_new_tokens=120): i for i, prompt in enumerate(short)}
    tokens = eng.run()
    assert eng.preemptions > 0 and eng.stats()["pages_in_use"] == 0
    for request, index in ids.items():
        assert tokens[request] == reference(model, "full", short[index], 120, prefill_chunk=64), (
            index
        )


def test_a_mesh_that_does_not_divide_the_slots_is_refused_before_anything_runs(model):
    mesh = sharding.make_inference_mesh(data=2, model=4)
    with pytest.raises(ValueError, match="max_slots=3 must be a multiple of the mesh's data"):
        Engine(model, cache=CacheConfig(num_pages=64), max_slots=3, mesh=mesh)
    with pytest.raises(ValueError, match="max_prefills=1 must be a multiple"):
        Engine(model, cache=CacheConfig(num_pages=64), max_slots=2, max_prefills=1, mesh=mesh)


@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_int8_storage_on_a_2x4_mesh_gives_one_device_s_tokens(model, name):
    """Each device's int8 tier beside its pool: the rows' tiers split with their heads."""
    policy, _ = POLICIES[name]()
    int8 = dict(storage="int8", full_precision_window=32)
    mesh = sharding.make_inference_mesh(data=2, model=4)
    eng = Engine(
        model,
        policy,
        cache=CacheConfig(num_pages=128, int8_pages=96, **int8),
        max_slots=4,
        max_prefills=2,
        max_context=512,
        mesh=mesh,
        prefill_chunk=64,
    )
    ids = {eng.submit(prompt, max_new_tokens=8): i for i, prompt in enumerate(PROMPTS)}
    tokens = eng.run()
    assert eng.stats()["pages_in_use"] == eng.stats()["int8_pages_in_use"] == 0
    for request, index in ids.items():
        expected = reference(
            model, policy, PROMPTS[index], 8, prefill_chunk=64, cache=CacheConfig(**int8)
        )
        assert tokens[request] == expected, index
