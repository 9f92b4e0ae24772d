"""Sharded inference on 8 host CPU devices: `generate` / `compress_prompt` on (data, model)
meshes give one device's tokens and kept tokens, each device holding only its share of the cache.

The model is a Llama-shaped tiny model with 4 KV heads (8 query heads, MLP 128) so that the
model axis can split heads 2 or 4 ways; f32 throughout. Prompts have different lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies, sharding
from jaxkv.attention import gather_pages
from jaxkv.cache.slots import slot_view
from jaxkv.gates import fastkvzip as fastkvzip_gates
from jaxkv.gates import wgkv as wgkv_gates
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.LLAMA, num_heads=8, num_kv_heads=4, intermediate_size=128)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


def sharded_test_prompts() -> list[list[int]]:
    """Eight prompts of different lengths (also the multi-process test's)."""
    rng = np.random.default_rng(0)
    lengths = [160, 131, 150, 97, 144, 120, 158, 101]
    return [list(rng.integers(0, CONFIG.vocab_size, n)) for n in lengths]


@pytest.fixture(scope="module")
def prompts():
    return sharded_test_prompts()


def _mesh(data: int, model_shards: int) -> sharding.InferenceMesh:
    return sharding.InferenceMesh(sharding.make_inference_mesh(data, model_shards))


def expected_attention_statistics(config) -> dict:
    """Random query statistics of `config`'s shapes: a mean and a covariance A A^T / H per
    query head, different across heads (a mesh must give each device its heads' own)."""
    rng = np.random.default_rng(6)
    heads = (config.num_layers, config.num_heads, config.head_dim)
    factor = rng.standard_normal((*heads, config.head_dim))
    return {
        "query_mean": rng.standard_normal(heads).astype(np.float32),
        "query_covariance": (factor @ np.swapaxes(factor, -1, -2) / config.head_dim).astype(
            np.float32
        ),
    }


POLICY_PARAMS = {
    "wgkv": lambda: wgkv_gates.init_write_gates(CONFIG, jax.random.PRNGKey(3)),
    "fastkvzip": lambda: fastkvzip_gates.init_params(CONFIG, jax.random.PRNGKey(4)),
    "duo_attention": lambda: np.array([[True, False, False, True], [False, True, False, False]]),
    "qfilter": lambda: policies.get("qfilter").params.init(CONFIG, jax.random.PRNGKey(5)),
    "expected_attention_stats": lambda: expected_attention_statistics(CONFIG),
    "kvzap": lambda: policies.get("kvzap").params.init(CONFIG, jax.random.PRNGKey(7)),
    "lukv": lambda: {  # a random budget curve: every head its own count
        "prune_shares": np.random.default_rng(8)
        .uniform(0, 1, (CONFIG.num_layers, 99, CONFIG.num_kv_heads))
        .astype(np.float32)
    },
}

# The replay policies' prompts in the tiny vocabulary (their byte-level defaults lie outside it).
REPLAY_IDS = dict(repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6), suffix_ids=(7,))

# Every registered policy, with options that make it evict at these prompt lengths.
POLICIES = {
    "full": {},
    "streaming_llm": dict(budget=0.3),
    "sliding_window": dict(budget=0.3),
    "snapkv": dict(budget=0.3, window=8),
    "pyramidkv": dict(budget=0.3, window=8),
    "tova": dict(budget=0.3),
    "knorm": dict(budget=0.3),
    "expected_attention": dict(budget=0.3, future_positions=16),
    "h2o": dict(budget=0.3, evict_every=4),
    "observed_attention": dict(budget=0.3),
    "adakv": dict(budget=0.3, inner=policies.get("snapkv", window=8)),
    "kvzip": dict(budget=0.3, repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6)),
    "gvote": {},
    "sage_kv": dict(budget=40),
    "confkv": dict(tight=32, loose=48, protected=8, evict_every=4),
    "scissorhands": dict(budget=0.3, evict_every=4),
    "quest": dict(budget=0.3),
    "local_attention": dict(window=32),
    "wgkv": dict(window=32, tau=0.5),
    "duo_attention": dict(window=32),
    "fastkvzip": dict(budget=0.4, window=8, decode_buffer=4),
    "keydiff": dict(budget=0.3),
    "lagkv": dict(budget=0.3, lag_size=8),
    "cur": dict(budget=0.3),
    "random": dict(budget=0.3),
    "chunkkv": dict(budget=0.3, inner=policies.get("snapkv", window=8), chunk_length=8),
    "chunk": dict(budget=0.3, inner="cur", chunk_length=16),
    "block": dict(budget=0.3, inner="keydiff", block_size=8),
    "criticalkv": dict(budget=0.3, inner=policies.get("snapkv", window=8)),
    "critical_adakv": dict(budget=0.3, inner=policies.get("snapkv", window=8)),
    "decoding": dict(target_size=16, compression_interval=4),
    "cam": dict(target_size=96, compression_interval=4, merge_budget=8),
    "ratio_decoding": dict(budget=0.3, compression_interval=4),
    "per_layer": dict(budgets=(0.2, 0.5)[: CONFIG.num_layers], inner="keydiff"),
    "dms": dict(threshold=-1.0, window=8),
    "simlayerkv": dict(lazy_threshold=0.2, n_recent=16),
    "think": dict(key_channel_ratio=0.5, window=8),
    "key_rerotation": dict(budget=0.3, inner="keydiff"),
    "merging": dict(budget=0.3, inner="keydiff"),
    "finch": dict(budget=0.3, window=8),
    "cap": dict(budget=0.3, future_positions=16),
    "entropy_chunkkv": dict(budget=0.3, inner=policies.get("snapkv", window=8), chunk_length=8),
    "qfilter": dict(budget=0.3),
    "expected_attention_stats": dict(budget=0.3, future_positions=16),
    "leverage": dict(budget=0.3, sketch_dimension=8),
    "kvzap": dict(budget=0.3),
    "kvcompose": dict(budget=0.3),
    "kvgrad": dict(budget=0.3, chunk=64, **REPLAY_IDS),
    "lukv": dict(budget=0.3, inner="keydiff"),
    "noncausal_attention": dict(budget=0.3, block_size=16),
    "compactor": dict(budget=0.3, block_size=16, sketch_dimension=8),
}


def test_every_registered_policy_is_covered():
    assert set(POLICIES) == set(policies.registered())


def _run(name, model, prompts, mesh=None):
    return jaxkv.generate(
        model,
        prompts,
        max_new_tokens=NEW_TOKENS,
        policy=policies.get(name, **POLICIES[name]),
        stop_tokens=[],
        policy_params=POLICY_PARAMS[name]() if name in POLICY_PARAMS else None,
        mesh=None if mesh is None else mesh.mesh,
    )


@pytest.mark.parametrize("shape", [(8, 1), (1, 2), (2, 4)])
def test_full_cache_tokens_and_pages_equal_one_device(model, prompts, shape):
    mesh = _mesh(*shape)
    one = _run("full", model, prompts)
    sharded = _run("full", model, prompts, mesh)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.pages_in_use, one.pages_in_use)
    np.testing.assert_array_equal(sharded.memory_bytes, one.memory_bytes)


# The policies the issue names, every policy with a decision across heads (AdaKV, KVzip, Fast
# KVzip, TOVA and Conf-KV's per-layer ranking) and every kind of decode-time eviction.
@pytest.mark.parametrize(
    "name", ["snapkv", "adakv", "wgkv", "fastkvzip", "kvzip", "tova", "confkv", "h2o", "gvote"]
)
def test_policy_tokens_equal_one_device_on_a_2x4_mesh(model, prompts, name):
    one = _run(name, model, prompts)
    sharded = _run(name, model, prompts, _mesh(2, 4))
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.pages_in_use, one.pages_in_use)
    assert one.pages_in_use[-1] < _run("full", model, prompts).pages_in_use[-1]


def test_cam_merges_as_one_device_with_rows_split_and_keeps_its_pages_with_heads_split(
    model, prompts
):
    """CaM draws each row's merges over every head: rows split 2 ways give one device's tokens.
    With heads split, its Knorm scores differ from one device's in the last bits (as `knorm`'s)
    and a near tie may keep another token; the pages are one device's."""
    one = _run("cam", model, prompts)
    rows = _run("cam", model, prompts, _mesh(2, 1))
    np.testing.assert_array_equal(rows.tokens, one.tokens)
    heads = _run("cam", model, prompts, _mesh(2, 4))
    np.testing.assert_array_equal(heads.pages_in_use, one.pages_in_use)
    assert one.pages_in_use[-1] < _run("full", model, prompts).pages_in_use[-1]


def test_int8_storage_tokens_and_bytes_equal_one_device(model, prompts):
    policy = policies.get("h2o", budget=0.5, evict_every=4)
    int8 = jaxkv.CacheConfig(storage="int8", full_precision_window=32)
    kwargs = dict(max_new_tokens=NEW_TOKENS, policy=policy, cache=int8, stop_tokens=[])
    one = jaxkv.generate(model, prompts[:4], **kwargs)
    sharded = jaxkv.generate(model, prompts[:4], mesh=_mesh(2, 2).mesh, **kwargs)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.int8_pages_in_use, one.int8_pages_in_use)
    assert one.int8_pages_in_use[-1] > 0
    np.testing.assert_array_equal(sharded.memory_bytes, one.memory_bytes)


def _kept(state, per_slot, mesh=None):
    """[L, B, K, S] `per_slot(kv)` of every head (the whole request's), sorted."""
    if mesh is None:
        return np.sort(np.asarray(per_slot(state)), axis=-1)
    stacked = jax.vmap(per_slot)(state)
    return np.sort(mesh.unshard(stacked, row_axis=1, head_axis=2), axis=-1)


def _kept_positions(state, mesh=None):
    """int32 [L, B, K, S] sorted kept positions of every head (the whole request's)."""
    return _kept(state, lambda kv: kv.positions(), mesh)


def _key_norms(kv):
    """f32 [L, B, K, S] the kept keys' L2 norms per head slot, 0 padded."""
    norms = jnp.linalg.norm(kv.pool.k_pages.astype(jnp.float32), axis=-1)  # [P, p]
    return slot_view(norms, kv.page_table, kv.lengths, 0.0)


def _assert_same_choice_up_to_ties(sharded, one, mesh, key_norms: bool):
    """Knorm ranks by key norm, LeverageScore by the keys' leverage; a device holding fewer
    heads computes the keys in another summation order, so two tokens whose scores agree to
    the last bits may swap (leverage solves a small system per head, which magnifies the
    rounding: on an AVX-512 CPU 4 of 696 kept tokens swapped, at most 2 in a head). Every head
    keeps as many tokens, at most two per head and 1% of the request's differ, and (Knorm) the
    kept keys' norms agree to float precision."""
    kept, expected = _kept_positions(sharded, mesh), _kept_positions(one)
    slots = kept.shape[-1]
    swapped = 0
    for got, want in zip(kept.reshape(-1, slots), expected.reshape(-1, slots), strict=True):
        assert (got >= 0).sum() == (want >= 0).sum()
        differ = len(np.setdiff1d(want[want >= 0], got))
        assert differ <= 2
        swapped += differ
    assert swapped <= 0.01 * (expected >= 0).sum()
    if key_norms:
        np.testing.assert_allclose(
            _kept(sharded, _key_norms, mesh), _kept(one, _key_norms), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"full"}))
def test_kept_tokens_equal_one_device_with_heads_split_four_ways(model, prompts, name):
    mesh = _mesh(1, 4)
    kwargs = dict(
        policy=policies.get(name, **POLICIES[name]),
        policy_params=POLICY_PARAMS[name]() if name in POLICY_PARAMS else None,
    )
    one = jaxkv.compress_prompt(model, prompts[:2], **kwargs)
    sharded = jaxkv.compress_prompt(model, prompts[:2], mesh=mesh.mesh, **kwargs)
    if name in ("knorm", "leverage"):
        _assert_same_choice_up_to_ties(sharded, one, mesh, key_norms=name == "knorm")
    else:
        np.testing.assert_array_equal(_kept_positions(sharded, mesh), _kept_positions(one))


def test_each_device_holds_the_pages_of_its_rows_and_heads(model, prompts):
    mesh = _mesh(2, 2)
    one = jaxkv.compress_prompt(model, prompts)
    sharded = jaxkv.compress_prompt(model, prompts, mesh=mesh.mesh)
    held = np.asarray(one.page_table) >= 0  # [L, B, K, M]
    rows, heads = np.split(np.arange(8), 2), np.split(np.arange(4), 2)
    expected = [held[:, r][:, :, h].sum() for r in rows for h in heads]
    np.testing.assert_array_equal(np.asarray(sharded.pages_in_use()), expected)
    # Every device's pool array is its own (one shard of the stacked pool), and smaller than
    # the one device's pool.
    shards = sharded.pool.k_pages.addressable_shards
    assert sorted(shard.device.id for shard in shards) == [d.id for d in mesh.mesh.devices.flat]
    assert all(shard.data.shape[0] == 1 for shard in shards)
    assert sharded.pool.num_pages < one.pool.num_pages


def test_sharded_keys_are_the_one_device_keys(model, prompts):
    mesh = _mesh(2, 2)
    one = jaxkv.compress_prompt(model, prompts)
    sharded = jaxkv.compress_prompt(model, prompts, mesh=mesh.mesh)

    def keys(kv):  # [L, B, K, S, H]
        return jax.vmap(lambda table: gather_pages(kv.pool.k_pages, table))(kv.page_table)

    held = np.arange(one.max_tokens_per_head) < np.asarray(one.lengths)[..., None]
    whole = mesh.unshard(jax.vmap(keys)(sharded), row_axis=1, head_axis=2)
    expected = np.asarray(keys(one))
    # A device multiplies matrices of its own shapes (its heads' columns) and sums the output
    # projection's and MLP's partial products in another order: f32 rounding, which layer 0
    # shows at its size and the next layer amplifies (random weights of scale 0.3).
    np.testing.assert_allclose(whole[0][held[0]], expected[0][held[0]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whole[held], expected[held], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape, batch, match",
    [
        ((3, 1), 8, "mesh axis 'data' has 3 devices and the batch 8 prompts"),
        ((1, 8), 2, "'model' has 8 devices and the model's num_kv_heads=4"),
    ],
)
def test_a_mesh_that_does_not_divide_is_refused_before_compiling(model, shape, batch, match):
    mesh = sharding.make_inference_mesh(*shape)
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(model, [[1, 2, 3]] * batch, max_new_tokens=2, mesh=mesh)


def test_bad_meshes_are_named_errors():
    with pytest.raises(ValueError, match="inference meshes have the axes"):
        sharding.InferenceMesh(jax.make_mesh((2,), ("batch",)))
    with pytest.raises(ValueError, match="jax.distributed is not initialised"):
        sharding.make_inference_mesh(4, 4)
    with pytest.raises(ValueError, match="model=0"):
        sharding.make_inference_mesh(1, 0)


def test_a_stacked_state_refuses_single_device_views(model, prompts):
    sharded = jaxkv.compress_prompt(model, prompts[:2], mesh=_mesh(1, 2).mesh)
    with pytest.raises(ValueError, match="per-device states stacked"):
        sharded.positions()


def test_sampled_tokens_equal_one_device(model, prompts):
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        policy=policies.get("snapkv", **POLICIES["snapkv"]),
        stop_tokens=[],
        sampler=jaxkv.Sampler(temperature=1.0, top_k=16),
        key=jax.random.PRNGKey(7),
    )
    one = jaxkv.generate(model, prompts, **kwargs)
    sharded = jaxkv.generate(model, prompts, mesh=_mesh(2, 2).mesh, **kwargs)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    greedy = jaxkv.generate(model, prompts, **{**kwargs, "sampler": None, "key": None})
    assert not np.array_equal(one.tokens, greedy.tokens)  # it did sample
