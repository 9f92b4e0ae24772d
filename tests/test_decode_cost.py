"""What a request costs beyond its attention: decode-time eviction in blocks, decode pools sized
by the budget, budgets as caps, bucketed shapes that bound recompilation, long-context defaults."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import generation, policies
from jaxkv.cache import geometry
from jaxkv.generation import loop as decode_module
from jaxkv.generation import prefill as prefill_module
from jaxkv.generation import request as request_module
from jaxkv.models import init_model
from jaxkv.policies.eviction import ScoredDecodeEviction
from tests.tiny_models import tiny_config

CONFIG = tiny_config(max_position_embeddings=8192)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.3)


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, CONFIG.vocab_size, length).tolist()


def _kept(state) -> list[list[int]]:
    positions = np.asarray(state.positions())
    return [sorted(p[p >= 0].tolist()) for p in positions.reshape(-1, positions.shape[-1])]


EVICTION_POSITIONS: list[int] = []


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CountingEviction(ScoredDecodeEviction):
    """A decode eviction part that records the position its one row wrote when it runs (-1:
    the row was not due)."""

    def on_decode(self, kv, ctx):
        jax.debug.callback(lambda at: EVICTION_POSITIONS.append(int(at[0])), ctx.positions)
        return super().on_decode(kv, ctx)


@dataclasses.dataclass(frozen=True)
class _CountingStreamingLLM(policies.StreamingLLM):
    """StreamingLLM whose decode eviction records the steps it runs on."""

    def _parts(self):
        record = super()._parts()
        part = record["decode_eviction"]
        counting = _CountingEviction(**dataclasses.asdict(part) | {"scorer": part.scorer})
        return record | {"decode_eviction": counting}


def test_window_eviction_runs_every_n_steps_and_equals_per_step_eviction_then(model):
    prompt = [_prompt(60)]
    kwargs = dict(max_new_tokens=9, stop_tokens=(), cache=jaxkv.CacheConfig(page_size=4))
    per_step = jaxkv.generate(
        model, prompt, policy=policies.StreamingLLM(budget=20, evict_every=1), **kwargs
    )
    EVICTION_POSITIONS.clear()
    blocked = jaxkv.generate(
        model, prompt, policy=_CountingStreamingLLM(budget=20, evict_every=4), **kwargs
    )
    # Steps 1..8 write a token each (step s at position 59 + s); the hook (and its compaction)
    # runs on steps 4 and 8 only.
    assert EVICTION_POSITIONS == [63, 67]
    assert _kept(blocked.state) == _kept(per_step.state)  # step 8 evicted: the same window
    assert np.all(np.asarray(blocked.state.lengths) == 20)
    # Between evictions the heads hold up to 4 tokens more: pages (of 4 tokens) grow, then drop.
    heads = CONFIG.num_layers * CONFIG.num_kv_heads
    assert blocked.pages_in_use.max() <= heads * (20 + 4) // 4
    assert blocked.pages_in_use[3] > blocked.pages_in_use[4]


def test_h2o_in_blocks_holds_at_most_budget_plus_block_and_keeps_the_recent_window(model):
    prompt = [_prompt(80, seed=4)]
    policy = policies.H2O(budget=24, recent=6, sinks=2, evict_every=4)
    out = jaxkv.generate(model, prompt, max_new_tokens=11, stop_tokens=(), policy=policy)
    lengths = np.asarray(out.state.lengths)
    assert np.all(lengths == 24 + 2)  # evicted to 24 at step 8, two tokens written since
    last = 80 + 11 - 2
    for kept in _kept(out.state):
        assert set(range(last - 7, last + 1)) <= set(kept) and {0, 1} <= set(kept)


@pytest.mark.parametrize(
    "make",
    [
        lambda: policies.H2O(budget=4096),
        lambda: policies.H2O(budget=1.0),
        lambda: policies.StreamingLLM(budget=1.0),
        lambda: policies.SnapKV(budget=4096, window=8),
    ],
)
def test_a_budget_above_the_sequence_keeps_everything(model, make):
    prompt = [_prompt(30, seed=5)]
    full = jaxkv.generate(model, prompt, max_new_tokens=20, stop_tokens=())
    capped = jaxkv.generate(model, prompt, max_new_tokens=20, stop_tokens=(), policy=make())
    np.testing.assert_array_equal(capped.tokens, full.tokens)
    assert np.all(np.asarray(capped.state.lengths) == 30 + 19)


def test_a_ratio_budget_keeps_its_share_of_the_growing_sequence(model):
    prompt = [_prompt(100, seed=6)]
    policy = policies.StreamingLLM(budget=0.5, evict_every=1)
    out = jaxkv.generate(model, prompt, max_new_tokens=21, stop_tokens=(), policy=policy)
    # The newest position written is 119: floor(0.5 * 120) tokens per head.
    assert np.all(np.asarray(out.state.lengths) == 60)


@pytest.mark.parametrize(
    "make",
    [
        lambda: policies.StreamingLLM(budget=64),
        lambda: policies.H2O(budget=64, recent=8),
        lambda: policies.ConfKV(tight=32, loose=64, protected=8),
        lambda: policies.SageKV(budget=64),
    ],
)
def test_decode_pool_is_sized_by_the_budget_not_the_generation(model, make):
    cfg = tiny_config(num_layers=4, num_kv_heads=4, num_heads=8, max_position_embeddings=8192)
    wide = init_model(cfg, seed=0)
    prompt = [np.random.default_rng(7).integers(1, 64, 3000).tolist()]
    kwargs = dict(max_new_tokens=1000, stop_tokens=(), cache=jaxkv.CacheConfig(page_size=16))
    policy = make()
    request = request_module.set_up(
        wide,
        prompt,
        policy,
        reserve_tokens=999,
        positions_after_prompt=1000,
        cache=jaxkv.CacheConfig(page_size=16),
        prefill_chunk=None,
        policy_params=None,
    )
    heads = cfg.num_layers * cfg.num_kv_heads
    full_pages = geometry.pool_pages_bucket(heads * -(-(3000 + 999) // 16), 16)
    bound = policy.decode_eviction.decode_tokens_bound(
        request.budget_tokens, request.prompts.lengths, 1000
    )
    assert int(bound[0]) <= 64 + policy.decode_eviction.decode_interval
    expected = geometry.pool_pages_bucket(heads * (-(-int(bound[0]) // 16) + 1), 16)
    assert expected < full_pages / 10
    out = jaxkv.generate(wide, prompt, policy=policy, **dict(kwargs, max_new_tokens=40))
    assert out.state.pool.num_pages <= geometry.pool_pages_bucket(
        heads * (-(-(64 + policy.decode_eviction.decode_interval) // 16) + 1), 16
    )


def test_full_cache_prefill_state_goes_to_decode_without_a_copy(model):
    before = decode_module.repack_program.jitted._cache_size()
    out = jaxkv.generate(model, [_prompt(300)], max_new_tokens=5, stop_tokens=())
    assert decode_module.repack_program.jitted._cache_size() == before
    heads = CONFIG.num_layers * CONFIG.num_kv_heads
    assert out.state.pool.num_pages == geometry.pool_pages_bucket(heads * -(-(300 + 4) // 16), 16)


def test_decode_keeps_the_prefill_pool_when_a_repack_would_save_less_than_half(model, monkeypatch):
    """SnapKV at 0.7 keeps 70% of the prompt: its decode pool would be more than half the
    prefill pool, so decode runs in the prefill pool (a repack would hold both at once). The
    tokens and the kept positions are those of a run that repacks."""
    prompts = [_prompt(2500, seed=1), _prompt(1900, seed=2)]
    kwargs = dict(max_new_tokens=12, stop_tokens=(), policy=policies.SnapKV(budget=0.7, window=8))
    before = decode_module.repack_program.jitted._cache_size()
    kept = jaxkv.generate(model, prompts, **kwargs)
    assert decode_module.repack_program.jitted._cache_size() == before  # no repack compiled
    request = request_module.set_up(
        model,
        prompts,
        kwargs["policy"],
        reserve_tokens=11,
        positions_after_prompt=12,
        cache=jaxkv.CacheConfig(),
        prefill_chunk=None,
        policy_params=None,
    )
    assert kept.state.pool.num_pages == request.kv.pool.num_pages
    monkeypatch.setattr(decode_module, "keeps_prefill_pool", lambda *a, **k: False)
    repacked = jaxkv.generate(model, prompts, **kwargs)
    assert repacked.state.pool.num_pages < kept.state.pool.num_pages
    assert repacked.state.page_table.shape == kept.state.page_table.shape
    np.testing.assert_array_equal(np.asarray(kept.tokens), np.asarray(repacked.tokens))
    assert _kept(kept.state) == _kept(repacked.state)
    np.testing.assert_array_equal(np.asarray(kept.memory_bytes), np.asarray(repacked.memory_bytes))


def test_generate_frees_the_prefill_pool_before_its_decode_loop(model, monkeypatch):
    """Once repacked into the decode geometry nothing reads the prefill pool: `generate` frees
    it before its decode loop (its own session would keep it alive beside the decode pool),
    while `decode` leaves a caller's session whole."""
    from jaxkv.generation import decoding

    seen = []
    to_decode_geometry, decode_loop = decoding.to_decode_geometry, decoding.decode_loop

    def repacking(kv, *args, **kwargs):
        seen.append(kv)
        return to_decode_geometry(kv, *args, **kwargs)

    def looking(*args, **kwargs):
        prefill_pool = jax.tree.leaves(seen[-1].pool)
        seen.append([leaf.is_deleted() for leaf in prefill_pool])
        return decode_loop(*args, **kwargs)

    monkeypatch.setattr(decoding, "to_decode_geometry", repacking)
    monkeypatch.setattr(decoding, "decode_loop", looking)
    prompts = [_prompt(2500, seed=1), _prompt(1900, seed=2)]
    policy = policies.SnapKV(budget=0.25, window=8)
    kwargs = dict(max_new_tokens=6, stop_tokens=())
    out = jaxkv.generate(model, prompts, policy=policy, **kwargs)
    assert out.state.pool.num_pages < seen[0].pool.num_pages  # repacked
    assert seen[1] and all(seen[1])  # every prefill pool array freed before the loop

    session = jaxkv.prefill(model, prompts, policy, reserve_tokens=5)
    first = jaxkv.decode(session, 6, stop_tokens=())
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(session.kv))
    again = jaxkv.decode(session, 6, stop_tokens=())
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.tokens, out.tokens)


def test_keeps_prefill_pool_only_when_the_decode_pool_is_over_half_of_it():
    from jaxkv.cache import keeps_prefill_pool

    assert keeps_prefill_pool(1000, 501) and keeps_prefill_pool(1000, 1000)
    assert not keeps_prefill_pool(1000, 500)
    assert not keeps_prefill_pool(1000, 1001)  # more than the prefill pool: repacked
    assert not keeps_prefill_pool(1000, 900, int8=True)


def test_a_stream_of_requests_compiles_a_bounded_number_of_times(model):
    programs = (
        prefill_module.prefill_and_compress,
        decode_module.repack_program,
        decode_module.decode_loop,
    )
    functions = [p.jitted for p in programs]
    before = [f._cache_size() for f in functions]
    rng = np.random.default_rng(8)
    for index, budget in enumerate((0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 1.0)):
        length = int(rng.integers(130, 250))
        jaxkv.generate(
            model,
            [_prompt(length, seed=index)],
            max_new_tokens=int(rng.integers(3, 40)),
            stop_tokens=(),
            policy=policies.SnapKV(budget=budget, window=8),
        )
    compiles = [f._cache_size() - b for f, b in zip(functions, before, strict=True)]
    assert all(count <= 3 for count in compiles), compiles


def test_fastkvzip_defaults_work_at_long_context(model):
    policy = policies.FastKVzip(ratio=0.3)
    lengths = np.array([131072])
    assert policy.chunk_eviction.prefill_chunk(lengths, generation.DEFAULT_PREFILL_CHUNK) == 16384
    policy.check_prefill(lengths, 16384)
    with pytest.raises(ValueError, match="give prefill_chunk >= 4096"):
        policy.check_prefill(lengths, 512)
    # Short prompts keep the default chunk (the window is 2% of the prompt).
    assert policy.chunk_eviction.prefill_chunk(np.array([2048]), 512) == 512


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an integer"),
        (dict(max_new_tokens=True), "max_new_tokens=True must be an integer"),
        (dict(prompt_ids="def f(x):"), "not text: encode the prompt first"),
        (dict(prompt_ids=[["a", "b"]]), "token ids are integers"),
        (dict(prefill_chunk=0), "prefill_chunk=0 must be >= 1"),
        (dict(policy="snapkv"), "policy 'snapkv' needs budget="),
        (dict(policy="snapkv:2.5"), "a ratio of the prompt in"),
        (dict(policy="no_such_policy:0.3"), "registered policies are"),
    ],
)
def test_bad_requests_raise_before_compiling(model, kwargs, match):
    arguments = dict(prompt_ids=[_prompt(20)], max_new_tokens=4) | kwargs
    prompt_ids = arguments.pop("prompt_ids")
    with pytest.raises(ValueError, match=match):
        jaxkv.generate(model, prompt_ids, **arguments)


@pytest.mark.parametrize("make", [policies.StreamingLLM, policies.H2O, policies.ConfKV])
def test_evict_every_must_be_a_positive_integer(make):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="evict_every="):
            make(evict_every=bad)


def _admit_all_gates(cfg):
    from jaxkv.gates.wgkv import init_write_gates

    params = init_write_gates(cfg, jax.random.PRNGKey(0))
    return params | {"w2": jnp.zeros_like(params["w2"]), "b2": jnp.full_like(params["b2"], 8.0)}


def test_admission_prefill_pool_starts_small_and_grows_only_as_tokens_are_admitted(model):
    prompt = [_prompt(1500, seed=9)]
    gates = _admit_all_gates(CONFIG)
    policy = policies.WGKV(tau=0.5, window=32)
    kwargs = dict(policy=policy, policy_params=gates, prefill_chunk=128)
    pages_16 = jaxkv.CacheConfig(page_size=16)
    fixed_pool = jaxkv.CacheConfig(page_size=16, num_pages=512)  # one pool, no growth
    grows_before = prefill_module.grow_pool.jitted._cache_size()
    grown = jaxkv.compress_prompt(model, prompt, cache=pages_16, **kwargs)
    assert (
        prefill_module.grow_pool.jitted._cache_size() > grows_before
    )  # every token admitted: it grew
    fixed = jaxkv.compress_prompt(model, prompt, cache=fixed_pool, **kwargs)
    assert _kept(grown) == _kept(fixed)
    np.testing.assert_array_equal(
        np.asarray(grown.token_scores()), np.asarray(fixed.token_scores())
    )
    out = jaxkv.generate(model, prompt, max_new_tokens=6, stop_tokens=(), cache=pages_16, **kwargs)
    want = jaxkv.generate(
        model, prompt, max_new_tokens=6, stop_tokens=(), cache=fixed_pool, **kwargs
    )
    np.testing.assert_array_equal(out.tokens, want.tokens)
    # Sinks-only admission never grows past the smallest pool, whatever the prompt length.
    local = jaxkv.compress_prompt(
        model, [_prompt(4000)], policies.LocalAttention(window=32), prefill_chunk=256
    )
    heads = CONFIG.num_layers * CONFIG.num_kv_heads
    assert local.pool.num_pages == geometry.MIN_POOL_PAGES < heads * 4000 // 16


def test_pools_and_tables_come_in_eight_sizes_per_octave_at_most_an_eighth_over():
    from jaxkv.cache.geometry import MIN_TABLE_PAGES, pool_pages_bucket, table_pages_bucket

    for pages in range(1, 5000):
        assert pages <= table_pages_bucket(pages) <= max(MIN_TABLE_PAGES, pages * 1.125)
        assert pages <= pool_pages_bucket(pages, 16) <= max(256, pages * 1.125)
    octave = {table_pages_bucket(pages) for pages in range(513, 1025)}
    assert sorted(octave) == [576, 640, 704, 768, 832, 896, 960, 1024]
    assert table_pages_bucket(8192 // 16 + 1) == 576  # one generated token past 8K tokens
