"""The shared eviction mechanism: real memory savings, intact kept tokens, decode-time eviction."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention, policies
from jaxkv.cache.eviction import compact
from jaxkv.cache.writes import accumulate_cached_mass
from jaxkv.generation import prefill as prefill_module
from jaxkv.models import init_model
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.step.forward import forward_cached
from tests import dense_reference
from tests.tiny_models import tiny_config

CONFIG = tiny_config(max_position_embeddings=4096)
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


BUDGETED = {
    "streaming_llm": lambda: policies.StreamingLLM(budget=0.25),
    "snapkv": lambda: policies.SnapKV(budget=0.25),
    "pyramidkv": lambda: policies.PyramidKV(budget=0.25, window=16),
    "tova": lambda: policies.TOVA(budget=0.25),
    "knorm": lambda: policies.Knorm(budget=0.25),
    "h2o": lambda: policies.H2O(budget=0.25),
    "observed_attention": lambda: policies.ObservedAttention(budget=0.25),
    "adakv": lambda: policies.AdaKV(inner=policies.SnapKV(), budget=0.25),
    "sage_kv": lambda: policies.SageKV(budget=0.25),
}


@pytest.fixture(scope="module")
def long_prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (2048, 1500)]


@pytest.fixture(scope="module")
def full_state(model, long_prompts):
    return jaxkv.compress_prompt(model, long_prompts, cache=jaxkv.CacheConfig(page_size=PAGE_SIZE))


def _pages_for(state):
    return int(np.sum(-(-np.asarray(state.lengths) // PAGE_SIZE)))


@pytest.mark.parametrize("name", [*sorted(BUDGETED), "gvote"])
def test_compression_really_frees_pages(model, long_prompts, full_state, name):
    # Random tokens on a random model spread attention thinly: a lower nucleus makes GVote prune.
    gvote = policies.GVote(nucleus=0.5, num_samples=2)
    policy = BUDGETED[name]() if name != "gvote" else gvote
    state = jaxkv.compress_prompt(
        model, long_prompts, policy, cache=jaxkv.CacheConfig(page_size=PAGE_SIZE)
    )
    # Pages held are exactly what the kept lengths need: nothing held beyond a partial last page.
    assert int(state.pages_in_use()) == _pages_for(state)
    assert state.memory_bytes() == _pages_for(state) * state.pool.page_bytes
    heads = CONFIG.num_layers * len(long_prompts) * CONFIG.num_kv_heads
    if name != "gvote":
        bound = 0.25 * full_state.memory_bytes() + heads * state.pool.page_bytes
        assert state.memory_bytes() <= bound
    else:
        assert state.memory_bytes() < full_state.memory_bytes()
    free = np.asarray(state.pool.allocator.free_stack)[: int(state.pool.allocator.num_free)]
    held = np.asarray(state.page_table)[np.asarray(state.page_table) >= 0]
    assert sorted(free.tolist() + held.tolist()) == list(range(state.pool.num_pages))


def test_kept_tokens_are_unchanged_and_in_order(model, long_prompts, full_state):
    state = jaxkv.compress_prompt(
        model,
        long_prompts,
        policies.AdaKV(inner=policies.SnapKV(), budget=0.25),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    full_keys = jax.vmap(lambda t: attention.gather_pages(full_state.pool.k_pages, t))(
        full_state.page_table
    )
    kept_keys = jax.vmap(lambda t: attention.gather_pages(state.pool.k_pages, t))(state.page_table)
    positions = np.asarray(state.positions())
    for index in np.ndindex(positions.shape[:3]):
        kept = positions[index][positions[index] >= 0]
        assert np.all(np.diff(kept) > 0)
        np.testing.assert_array_equal(
            np.asarray(kept_keys[index])[: len(kept)], np.asarray(full_keys[index])[kept]
        )


def test_decode_on_a_compressed_cache_attends_to_exactly_the_kept_tokens(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (200, 150)]
    state = jaxkv.compress_prompt(
        model, prompts, policies.SnapKV(budget=0.3, window=8), cache=jaxkv.CacheConfig(page_size=8)
    )
    positions = np.asarray(state.positions())
    keys, values = dense_reference.cached_keys_values(state)
    token = np.array([5, 9], np.int32)
    position = np.array([200, 150], np.int32)
    expected = dense_reference.decode_step_logits(model, token, position, keys, values)
    hidden, _, _ = jax.jit(
        lambda m, kv: forward_cached(
            m,
            jnp.asarray(token)[:, None],
            jnp.asarray(position)[:, None],
            kv,
            policy=policies.FullCache(),
        )
    )(model, state)
    got = np.asarray(logits_from_hidden(model.params, CONFIG, hidden))[:, 0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert positions.max() < 200


def test_streaming_llm_window_slides_during_decode(model):
    prompts = [list(range(1, 61)), list(range(2, 42))]
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=12,
        stop_tokens=(),
        policy=policies.StreamingLLM(budget=20, evict_every=1),
        cache=jaxkv.CacheConfig(page_size=4),
    )
    positions = np.asarray(out.state.positions())
    for b, length in enumerate((60, 40)):
        last = length + 12 - 2  # the newest written position (the last token is never written)
        expected = list(range(4)) + list(range(last - 15, last + 1))
        for index in np.ndindex(positions.shape[0], positions.shape[2]):
            kept = positions[index[0], b, index[1]]
            assert sorted(kept[kept >= 0].tolist()) == expected  # decode eviction: any order
    assert np.all(out.pages_in_use == out.pages_in_use[0])


def test_h2o_decode_keeps_budget_and_recent_window(model):
    prompts = [np.random.default_rng(4).integers(0, 64, 80).tolist()]
    policy = policies.H2O(budget=24, recent=6, sinks=2, evict_every=1)
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=10,
        stop_tokens=(),
        policy=policy,
        cache=jaxkv.CacheConfig(page_size=4),
    )
    lengths = np.asarray(out.state.lengths)
    assert np.all(lengths == 24)
    positions = np.asarray(out.state.positions())
    last = 80 + 10 - 2
    for index in np.ndindex(lengths.shape):
        kept = set(positions[index][positions[index] >= 0].tolist())
        assert set(range(last - 5, last + 1)) <= kept and {0, 1} <= kept


def test_sage_kv_recent_window_slides(model):
    prompts = [np.random.default_rng(5).integers(0, 64, 100).tolist()]
    # The paper's split, G = 2: sinks 32/4 = 8, top-k 32/(2*2) = 8 per query head (a power of
    # two already), recent 32 - 8 - 2*8 = 8.
    budget, recent = 32, 8
    state = jaxkv.compress_prompt(
        model, prompts, policies.SageKV(budget=budget), cache=jaxkv.CacheConfig(page_size=4)
    )
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=9,
        stop_tokens=(),
        policy=policies.SageKV(budget=budget, evict_every=1),
        cache=jaxkv.CacheConfig(page_size=4),
    )
    before, after = np.asarray(state.positions()), np.asarray(out.state.positions())
    last = 100 + 9 - 2
    for index in np.ndindex(before.shape[:3]):
        kept_before = before[index][before[index] >= 0]
        selected = kept_before[kept_before < 100 - recent]
        expected = sorted(set(selected.tolist()) | set(range(last - recent + 1, last + 1)))
        assert after[index][after[index] >= 0].tolist() == expected


def test_budget_changes_do_not_recompile(model, long_prompts):
    short = [p[:300] for p in long_prompts]
    jaxkv.compress_prompt(
        model,
        short,
        policies.SnapKV(budget=0.3, window=8),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    size = prefill_module.prefill_and_compress.jitted._cache_size()
    state = jaxkv.compress_prompt(
        model,
        short,
        policies.SnapKV(budget=0.1, window=8),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    assert prefill_module.prefill_and_compress.jitted._cache_size() == size
    assert np.all(np.asarray(state.lengths) == 30)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: policies.SnapKV(budget=0.0), r"ratio=0.0 must be in \(0, 1\]"),
        (lambda: policies.SnapKV(budget=1.5), r"ratio=1.5 must be in \(0, 1\]"),
        (
            lambda: policies.SnapKV(budget=-3),
            r"budget=-3: give a ratio in \(0, 1\] or a token count in \[1, ",
        ),
        (lambda: policies.get("nope"), "policy='nope'"),
        (lambda: policies.SnapKV(budget=0.3, kernel=4), "kernel=4"),
        (lambda: policies.GVote(nucleus=1.5), "nucleus=1.5"),
    ],
)
def test_bad_policy_arguments(make, match):
    with pytest.raises((ValueError, KeyError), match=match):
        make()


@pytest.mark.parametrize(
    ("policy", "length", "match"),
    [
        (
            policies.SnapKV(budget=40),
            100,
            r"budget of 40 tokens is smaller than the 64 tokens each head protects .*"
            "give budget >= 64",
        ),
        (policies.StreamingLLM(budget=3), 60, "smaller than the 4 tokens each head protects"),
        (policies.SnapKV(), 100, "needs budget="),
    ],
)
def test_budgets_checked_against_prompts_before_compiling(model, policy, length, match):
    prompts = [[i % 64 for i in range(length)], [i % 64 for i in range(length - 10)]]
    with pytest.raises(ValueError, match=match):
        jaxkv.compress_prompt(model, prompts, policy)


def test_compact_with_keep_all_is_identity(full_state):
    kept = compact(full_state, jnp.ones(full_state.positions().shape, bool))
    np.testing.assert_array_equal(np.asarray(kept.lengths), np.asarray(full_state.lengths))
    assert int(kept.pages_in_use()) == int(full_state.pages_in_use())


@pytest.mark.parametrize("name", ["snapkv", "h2o", "adakv", "sage_kv"])
def test_policies_run_in_bfloat16(model, name):
    bf16 = dataclasses.replace(
        model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params)
    )
    prompts = [[i % 64 for i in range(400)], [i % 61 for i in range(300)]]
    out = jaxkv.generate(
        bf16,
        prompts,
        max_new_tokens=4,
        policy=BUDGETED[name](),
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=8),
    )
    assert out.state.pool.k_pages.dtype == jnp.bfloat16
    lengths = np.asarray(out.state.lengths)
    # Per layer and sequence (AdaKV moves budget between heads), plus the 3 written decode tokens.
    per_head_budget = np.array([100, 75])[None, :]
    assert np.all(lengths.sum(-1) <= CONFIG.num_kv_heads * (per_head_budget + 3))
    assert np.all(np.isfinite(np.asarray(out.state.token_scores())))


def test_decode_runs_on_a_pool_sized_for_the_compressed_cache(model, long_prompts, full_state):
    prompts = long_prompts  # long enough for pools above the smallest pool bucket
    full = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=4,
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    snap = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=4,
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        policy=policies.SnapKV(budget=0.25),
    )
    # The arrays themselves shrink, not only the count of pages in use.
    assert snap.state.pool.k_pages.nbytes < 0.35 * full.state.pool.k_pages.nbytes
    assert snap.state.page_table.shape[-1] < 0.35 * full.state.page_table.shape[-1]
    assert int(snap.state.pages_in_use()) <= snap.state.pool.num_pages


def test_repack_preserves_every_held_token(full_state):
    from jaxkv.cache import decode_geometry, repack

    num_pages, max_pages = decode_geometry(full_state, 1)
    packed = jax.jit(repack, static_argnames=("num_pages", "max_pages"))(
        full_state, num_pages=num_pages, max_pages=max_pages
    )
    assert not bool(packed.pool.overflow)
    np.testing.assert_array_equal(
        np.asarray(packed.positions())[..., :2048], np.asarray(full_state.positions())[..., :2048]
    )
    keys = jax.vmap(lambda t: attention.gather_pages(packed.pool.k_pages, t))(packed.page_table)
    ref = jax.vmap(lambda t: attention.gather_pages(full_state.pool.k_pages, t))(
        full_state.page_table
    )
    held = np.asarray(full_state.positions()) >= 0
    np.testing.assert_array_equal(
        np.asarray(keys)[held[..., : keys.shape[3]]],
        np.asarray(ref)[..., : keys.shape[3], :][held[..., : keys.shape[3]]],
    )
    too_small = repack(full_state, num_pages=10, max_pages=max_pages)
    assert bool(too_small.pool.overflow)


def _scatters_into(text: str, rows: int) -> list[str]:
    """The op that produces the updates of each scatter in lowered StableHLO `text` whose
    operand has `rows` leading rows (a flattened per-token pool field)."""
    found = []
    for function in text.split("func.func")[1:]:
        producers = dict(re.findall(r"(%[\w#]+) = \"?([\w.]+)", function))
        for updates, operand_type in re.findall(
            r"\"stablehlo.scatter\"\(%[\w#]+, %[\w#]+, (%[\w#]+)\).*?\}\) : \(tensor<(\d+)",
            function,
            flags=re.S,
        ):
            if int(operand_type) == rows:
                found.append(producers[updates])
    return found


def test_moves_within_the_pool_scatter_materialised_tokens(full_state):
    # XLA's GPU compiler fuses a gather into the scatter that consumes it; a scatter fusion
    # that also reads the buffer it writes cannot write in place and copies the whole pool
    # (SnapKV's and H2O's prefill on an H200: a second 36.6 GiB pool, results/plan/h200).
    # Every scatter into a pool field must take its updates from an optimization barrier.
    pool = full_state.pool
    rows = pool.num_pages * pool.page_size
    keep = jnp.arange(full_state.max_tokens_per_head) % 3 == 0
    keep = jnp.broadcast_to(keep, full_state.lengths.shape + keep.shape)
    moves = _scatters_into(jax.jit(compact).lower(full_state, keep).as_text(), rows)
    assert len(moves) == 4  # keys, values, positions, scores
    assert set(moves) == {"stablehlo.optimization_barrier"}

    def accumulate(pool, page_table, lengths, mass):
        return accumulate_cached_mass(pool, page_table, lengths, mass, lambda old, new: old + new)

    mass = jnp.ones(full_state.page_table.shape[1:-1] + (full_state.max_tokens_per_head,))
    args = (pool, full_state.page_table[0], full_state.lengths[0], mass)
    updates = _scatters_into(jax.jit(accumulate).lower(*args).as_text(), rows)
    assert updates == ["stablehlo.optimization_barrier"]
