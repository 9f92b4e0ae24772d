"""kvpress's presses in jaxkv keep what kvpress 0.5.5 keeps: per layer and KV head, the positions
kept on small random Llama and Qwen3 models, against fixtures written in kvpress's own
environment (`tests/kvpress_presses/write_fixtures.py`, its command and versions in
`fixtures.json`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.models import byte_tokenizer, init_model, layers, load_hf_checkpoint
from jaxkv.policies import cam, compactor, leverage
from jaxkv.policies.noncausal import block_attention_sums

FIXTURES = Path(__file__).parent / "kvpress_presses"
META = json.loads((FIXTURES / "fixtures.json").read_text())
MODELS = ("llama", "qwen3")
# Scores within this of kvpress's lowest kept score are ties at the cut (float32 in torch and
# XLA sum in different orders): either side of the cut is kvpress's choice.
TIE_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.param, load_hf_checkpoint(FIXTURES / request.param, dtype="float32")


def kept_by_head(state, num_layers: int) -> list[list[set[int]]]:
    """[layer][head] the positions the (single-row) state holds."""
    kept = []
    for layer in range(num_layers):
        positions = np.asarray(state.positions(layer))[0]
        kept.append([set(int(p) for p in head[head >= 0]) for head in positions])
    return kept


def assert_keeps_as_kvpress(ours: set[int], theirs: set[int], scores, where: str) -> None:
    assert len(ours) == len(theirs), f"{where}: kept {len(ours)} tokens, kvpress {len(theirs)}"
    differ = ours ^ theirs
    if scores is None:
        assert not differ, f"{where}: kept {sorted(ours - theirs)}, kvpress {sorted(theirs - ours)}"
        return
    cut = min(scores[p] for p in theirs)
    off_cut = [p for p in differ if abs(scores[p] - cut) > TIE_TOLERANCE * max(1.0, abs(cut))]
    assert not off_cut, (
        f"{where}: positions {sorted(off_cut)} differ from kvpress's choice and do not tie at "
        f"its cut (scores {[float(scores[p]) for p in sorted(off_cut)]}, cut {cut})"
    )


@pytest.mark.parametrize("case", sorted(META["cases"]))
def test_kept_positions_equal_kvpress(model, case):
    name, loaded = model
    spec = META["cases"][case]
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    # the replay policies' prompts in the byte-level ids kvpress reads through its stand-in
    policy = policies.from_spec(spec).for_tokenizer(byte_tokenizer())
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], policy)
    ours = kept_by_head(state, loaded.config.num_layers)
    for layer, heads in enumerate(fixture["kept"]):
        for head, theirs in enumerate(heads):
            scores = fixture["scores"][layer, head] if "scores" in fixture else None
            assert_keeps_as_kvpress(
                ours[layer][head],
                set(int(p) for p in theirs[theirs >= 0]),
                scores,
                f"{name} {spec} layer {layer} head {head}",
            )


@pytest.mark.parametrize("case", sorted(META["channel_cases"]))
def test_zeroed_key_channels_equal_kvpress(model, case):
    """ThinK: every token kept, and in each head the same key channels zero in every key."""
    name, loaded = model
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    policy = policies.from_spec(META["channel_cases"][case])
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], policy)
    length = len(META["prompt"])
    pages = np.asarray(state.pool.k_pages)
    for layer, heads in enumerate(fixture["zeroed"]):
        for head, theirs in enumerate(heads):
            table = np.asarray(state.page_table)[layer, 0, head]
            keys = pages[table[table >= 0]].reshape(-1, pages.shape[-1])[:length]
            assert sorted(np.asarray(state.positions(layer))[0, head][:length]) == list(
                range(length)
            )
            ours = (keys == 0).all(axis=0)
            assert ours.tolist() == theirs.tolist(), f"{name} {case} layer {layer} head {head}"


@pytest.mark.parametrize("case", sorted(META["rotation_cases"]))
def test_rerotated_keys_and_tokens_equal_kvpress(model, case):
    """KeyRerotation: the inner press's kept positions; each head's kept keys rotated as
    kvpress rotates them (to 0, 1, ...) moved on by T - n, the prompt's length less layer 0's
    kept count, since kvpress's pipeline reads on from n where jaxkv reads on from T (float32
    rounding apart); and the same greedy tokens after the prompt as kvpress's pipeline."""
    name, loaded = model
    spec, kept_case, steps = META["rotation_cases"][case]
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    kept = np.load(FIXTURES / name / f"{kept_case}.npz")["kept"]
    policy = policies.from_spec(spec)
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], policy)
    pages = np.asarray(state.pool.k_pages)
    shift = len(META["prompt"]) - int((kept[0] >= 0).sum(-1).max())
    for layer, heads in enumerate(fixture["keys"]):
        positions = np.asarray(state.positions(layer))[0]
        for head, theirs in enumerate(heads):
            held = positions[head][positions[head] >= 0]
            assert held.tolist() == sorted(int(p) for p in kept[layer, head] if p >= 0)
            table = np.asarray(state.page_table)[layer, 0, head]
            keys = pages[table[table >= 0]].reshape(-1, pages.shape[-1])[: len(held)]
            cos, sin = layers.rope_cos_sin(loaded.config, np.full((1, len(held)), shift))
            moved = layers.apply_rope(theirs[None, None, : len(held)], cos, sin)[0, 0]
            np.testing.assert_allclose(keys, moved, rtol=1e-4, atol=1e-5)
    out = jaxkv.generate(loaded, [META["prompt"]], max_new_tokens=steps + 1, policy=policy)
    assert out.tokens[0][: int(out.num_tokens[0])].tolist() == fixture["tokens"].tolist()


def given_parameters(name: str, case: str) -> tuple[np.lib.npyio.NpzFile, dict]:
    """(the fixture, the parameters kvpress was given: every array but `kept` and `scores`)."""
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    return fixture, {key: fixture[key] for key in fixture.files if key not in ("kept", "scores")}


def assert_keeps_as_fixture(state, fixture, num_layers: int, where: str) -> None:
    ours = kept_by_head(state, num_layers)
    for layer, heads in enumerate(fixture["kept"]):
        for head, theirs in enumerate(heads):
            assert_keeps_as_kvpress(
                ours[layer][head],
                set(int(p) for p in theirs[theirs >= 0]),
                fixture["scores"][layer, head],
                f"{where} layer {layer} head {head}",
            )


WRITTEN_SCORE_CASES = META["filter_cases"] | META["surrogate_cases"]


@pytest.mark.parametrize("case", sorted(WRITTEN_SCORE_CASES))
def test_presses_scoring_tokens_as_written_keep_what_kvpress_keeps_with_its_parameters(model, case):
    """QFilter and KVzap, given kvpress's filters or surrogates: the scores stored with each
    token equal kvpress's (float32 rounding apart) and each head keeps kvpress's positions."""
    name, loaded = model
    fixture, params = given_parameters(name, case)
    policy = policies.from_spec(WRITTEN_SCORE_CASES[case])
    whole = dataclasses.replace(policy, budget=1.0)  # every token kept, in position order
    full = jaxkv.compress_prompt(loaded, [META["prompt"]], whole, policy_params=params)
    ours_scores = np.asarray(full.token_scores())[:, 0]  # [L, K, S]
    length = fixture["scores"].shape[-1]
    np.testing.assert_allclose(ours_scores[..., :length], fixture["scores"], rtol=1e-4, atol=1e-5)
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], policy, policy_params=params)
    assert_keeps_as_fixture(state, fixture, loaded.config.num_layers, f"{name} {case}")


GIVEN_PARAMETER_CASES = META["stats_cases"] | META["curve_cases"]


@pytest.mark.parametrize("case", sorted(GIVEN_PARAMETER_CASES))
def test_presses_given_kvpress_s_parameters_keep_what_kvpress_keeps(model, case):
    """ExpectedAttentionStats with kvpress's statistics, LU-KV with its budget curve."""
    name, loaded = model
    fixture, params = given_parameters(name, case)
    policy = policies.from_spec(GIVEN_PARAMETER_CASES[case])
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], policy, policy_params=params)
    assert_keeps_as_fixture(state, fixture, loaded.config.num_layers, f"{name} {case}")


@pytest.mark.parametrize("length", [1, 5, 12])
def test_noncausal_padding_past_a_short_chunk_equals_padding_written_out(length):
    """A chunk shorter than a block scores as the same chunk padded to the block with invalid
    positions (kvpress's padding), without forming the padding."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 4, 16, 8)), rng.standard_normal((1, 2, 16, 8))
    valid = np.arange(16)[None] < length - 1  # the last position is padding inside the chunk too
    short = block_attention_sums(q[:, :, :length], k[:, :, :length], valid[:, :length], 16)
    written_out = block_attention_sums(q, k, valid, 16)[..., :length]
    np.testing.assert_allclose(short, written_out, rtol=1e-6, atol=1e-7)


def test_noncausal_blocks_over_prefill_chunks_keep_what_one_chunk_keeps(model):
    """Blocks start at each chunk's first position: chunks of whole blocks score every block as
    one chunk does; a chunk that splits a block is refused before prefill."""
    _, loaded = model
    policy = policies.from_spec("noncausal_attention:0.5:block_size=32")
    whole = jaxkv.compress_prompt(loaded, [META["prompt"]], policy)
    chunked = jaxkv.compress_prompt(loaded, [META["prompt"]], policy, prefill_chunk=64)
    num_layers = loaded.config.num_layers
    assert kept_by_head(chunked, num_layers) == kept_by_head(whole, num_layers)
    with pytest.raises(ValueError, match="prefill_chunk=48 must be a multiple of block_size=32"):
        jaxkv.compress_prompt(loaded, [META["prompt"]], policy, prefill_chunk=48)


def full_cache_keys(loaded, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys f32 [1, K, T, H] after RoPE, positions [1, K, T]) of the prompt's full cache."""
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], "full")
    table = np.asarray(state.page_table)[layer, 0]
    pages = np.asarray(state.pool.k_pages)[np.maximum(table, 0)]  # [K, M, p, H]
    keys = pages.reshape(table.shape[0], -1, pages.shape[-1])[:, : len(META["prompt"])]
    positions = np.broadcast_to(np.arange(keys.shape[1]), keys.shape[:2])
    return keys[None], positions[None]


def _sketch_cases(policy: str) -> list[str]:
    return sorted(c for c, spec in META["sketch_cases"].items() if spec.split(":")[0] == policy)


def assert_kept_near_kvpress_cut(name: str, loaded, case: str, tolerance: float) -> None:
    """The sketch case's policy (jaxkv's own sketch) keeps kvpress's positions per head on
    model `name`, any choice among tokens within `tolerance` of kvpress's cut apart."""
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], META["sketch_cases"][case])
    ours_kept = kept_by_head(state, loaded.config.num_layers)
    for layer, heads in enumerate(fixture["kept"]):
        for head, theirs in enumerate(heads):
            theirs = set(int(p) for p in theirs[theirs >= 0])
            scores = fixture["scores"][layer, head]
            cut = min(scores[p] for p in theirs)
            differ = ours_kept[layer][head] ^ theirs
            off_cut = [p for p in differ if abs(scores[p] - cut) > tolerance]
            assert len(ours_kept[layer][head]) == len(theirs) and not off_cut, (layer, head)


@pytest.mark.parametrize("case", _sketch_cases("leverage"))
def test_leverage_scores_equal_kvpress_with_its_sketch(model, case):
    """LeverageScore: with kvpress's own Gaussian sketch, each layer's z-scored leverage equals
    kvpress's (float32 Cholesky solves apart); with a sketch wider than the head (k >= H the
    sketch changes the scores only through kvpress's jitter) jaxkv's own draw keeps kvpress's
    positions, ties at the cut apart."""
    name, loaded = model
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    for layer, theirs in enumerate(fixture["scores"]):
        keys, positions = full_cache_keys(loaded, layer)
        unrotated = leverage.unrotated_keys(loaded.config, jax.numpy.asarray(keys), positions)
        held = np.ones(positions.shape, bool)
        raw = leverage.leverage_scores(unrotated, held, fixture["sketch"][layer][None])
        ours = np.asarray(leverage.z_scores(raw, held))[0]
        np.testing.assert_allclose(ours, theirs, atol=5e-3, err_msg=f"{name} layer {layer}")
    if fixture["sketch"].shape[-1] >= loaded.config.head_dim:
        assert_kept_near_kvpress_cut(name, loaded, case, tolerance=0.02)


@pytest.mark.parametrize("case", _sketch_cases("compactor"))
def test_compactor_scores_equal_kvpress_with_its_sketch(model, case):
    """Compactor: with kvpress's own sketch, each layer's blend of z-scored leverage and
    non-causal block attention over the scored range equals kvpress's (the attention as the
    gate stored it at prefill); with a sketch wider than the head, jaxkv's own draw keeps
    kvpress's positions, ties at the cut apart."""
    name, loaded = model
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    policy = policies.from_spec(META["sketch_cases"][case])
    length = len(META["prompt"])
    whole = jaxkv.compress_prompt(loaded, [META["prompt"]], dataclasses.replace(policy, budget=1.0))
    scored = slice(policy.sinks, length - policy.recent)
    for layer, theirs in enumerate(fixture["scores"]):
        keys, positions = full_cache_keys(loaded, layer)
        unrotated = leverage.unrotated_keys(loaded.config, jax.numpy.asarray(keys), positions)
        in_range = compactor.scored_range(
            positions, np.array([length]), policy.sinks, policy.recent
        )
        attention = np.asarray(whole.token_scores(layer))[:, :, :length]
        sketch = fixture["sketch"][layer][None]
        ours = compactor.compactor_scores(unrotated, in_range, attention, sketch, policy.blending)
        np.testing.assert_allclose(
            np.asarray(ours)[0][:, scored],
            theirs[:, scored],
            atol=5e-3,
            err_msg=f"{name} layer {layer}",
        )
    if fixture["sketch"].shape[-1] >= loaded.config.head_dim:
        assert_kept_near_kvpress_cut(name, loaded, case, tolerance=0.02)


@pytest.mark.parametrize("case", sorted(META["merge_cases"]))
def test_merged_values_equal_kvpress(model, case):
    """Merging: the inner press's kept positions, and each kept token's value after the
    evicted values are merged as kvpress merges them (float32 rounding apart)."""
    name, loaded = model
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    policy = policies.from_spec(META["merge_cases"][case])
    state = jaxkv.compress_prompt(loaded, [META["prompt"]], policy)
    pages = np.asarray(state.pool.v_pages)
    merged = 0
    for layer, heads in enumerate(fixture["kept"]):
        positions = np.asarray(state.positions(layer))[0]
        for head, theirs in enumerate(heads):
            theirs = theirs[theirs >= 0]
            held = positions[head][positions[head] >= 0]
            assert sorted(held.tolist()) == sorted(theirs.tolist())
            table = np.asarray(state.page_table)[layer, 0, head]
            values = pages[table[table >= 0]].reshape(-1, pages.shape[-1])[: len(held)]
            by_position = dict(zip(held.tolist(), values, strict=True))
            ours = np.stack([by_position[int(p)] for p in theirs])
            expected = fixture["values"][layer, head, : len(theirs)]
            np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
            merged += int(np.sum(np.any(np.abs(ours) > 0, -1)))
    assert merged  # the values compared are the cache's, not all zeros


def test_random_keeps_the_budget_and_follows_the_key(model):
    _, loaded = model
    prompt = [META["prompt"]]
    policy = policies.from_spec("random:0.25")
    runs = [
        jaxkv.compress_prompt(loaded, prompt, policy, key=jax.random.key(seed))
        for seed in (0, 0, 1)
    ]
    # Room for 700 more tokens: a wider page table (as the engine's) draws the same scores.
    wider = jaxkv.prefill(loaded, prompt, policy, reserve_tokens=700, key=jax.random.key(0))
    assert wider.kv.page_table.shape[-1] > runs[0].page_table.shape[-1]
    kept = [kept_by_head(state, loaded.config.num_layers) for state in (*runs, wider.kv)]
    budget = int(0.25 * len(META["prompt"]))
    assert all(len(head) == budget for layer in kept[0] for head in layer)
    assert kept[0] == kept[1] == kept[3]
    assert kept[0] != kept[2]
    # Uniform: every position is as likely kept; the kept positions' mean is the prompt's middle.
    positions = [p for layer in kept[0] for head in layer for p in head]
    assert abs(np.mean(positions) - (len(META["prompt"]) - 1) / 2) < 0.15 * len(META["prompt"])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("chunk:0.5:inner=snapkv", "inner='snapkv' scores from queries"),
        ("block:0.5:inner=tova", "inner='tova' scores from queries"),
        ("chunkkv:0.5:inner=kvzip", "inner='kvzip' must be a scoring eviction policy"),
        ("chunkkv:64", "budget= as a ratio"),
        ("chunk:0.5:chunk_length=0", "chunk_length=0 must be >= 1"),
        ("lagkv:0.5:lag_size=1", "lag_size=1 must be >= 2"),
        ("cur:0.5:leverage_type=values", "leverage_type='values'"),
        ("kvcompose:0.5:task=sum", "task='sum' must be one of max, mean"),
        ("kvcompose:0.5:lower_bound=-1", "lower_bound=-1 must be >= 0"),
        ("kvcompose:64", "ratio of the prompt"),
        ("kvgrad:0.5:chunk=0", "chunk=0 must be an integer >= 1"),
        ("kvgrad:0.5:sinks=-1", "sinks=-1 must be an integer >= 0"),
        ("kvgrad:64", "ratio of the prompt"),
        ("lukv:0.5:inner=qfilter", "inner='qfilter' has learned parameters"),
        ("lukv:0.5:inner=kvzip", "inner='kvzip' must be a scoring eviction policy"),
        ("lukv:0.5:window=-1", "window=-1 must be an integer >= 0"),
        ("noncausal_attention:0.5:block_size=0", "block_size=0 must be >= 1"),
    ],
)
def test_bad_settings_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        policies.from_spec(spec)


@pytest.mark.parametrize("case", sorted(META["decoding_cases"]))
def test_compression_during_decode_keeps_what_kvpress_keeps(model, case):
    """kvpress's decoding presses, greedy from the same prompt: the same tokens, and the same
    positions held after the last step."""
    name, loaded = model
    spec, steps = META["decoding_cases"][case]
    fixture = np.load(FIXTURES / name / f"{case}.npz")
    out = jaxkv.generate(
        loaded, [META["prompt"]], max_new_tokens=steps + 1, policy=policies.from_spec(spec)
    )
    assert out.tokens[0][: int(out.num_tokens[0])].tolist() == fixture["tokens"].tolist()
    ours = kept_by_head(out.state, loaded.config.num_layers)
    for layer, heads in enumerate(fixture["kept"]):
        for head, theirs in enumerate(heads):
            assert ours[layer][head] == set(int(p) for p in theirs[theirs >= 0]), (
                f"{name} {spec} layer {layer} head {head}"
            )


@pytest.mark.parametrize("case", META["cam_cases"])
def test_cam_keeps_and_merges_as_kvpress_given_its_draws(case):
    """CaM's compression of one layer (kvpress's CAMPress.compress on random keys, values and
    cumulative attentions): the same tokens kept in every head, the same merge probabilities,
    and with kvpress's Bernoulli draws the same values after the merges."""
    fixture = np.load(FIXTURES / "cam" / f"{case}.npz")
    target, interval, merge_budget = (int(x) for x in fixture["settings"])
    keys, values = fixture["keys"], fixture["values"]
    held = np.ones(keys.shape[1], bool)
    keep, merging = cam.cam_choice(fixture["scores"].mean(0), held, target, interval)
    keep = np.asarray(keep)
    np.testing.assert_array_equal(fixture["kept_keys"], keys[:, keep])
    slots = np.flatnonzero(np.asarray(merging))  # kvpress's merge indices, ascending
    mask = fixture["mask"]
    assert len(slots) == mask.shape[-1] and 0 < mask.mean() < 1
    uniform = np.ones(fixture["attention"].shape, np.float32)
    uniform[:, slots] = np.where(mask > 0, 0.0, 1.0)  # merges exactly where kvpress drew 1
    probability, merged = cam.cam_merge(
        values, fixture["attention"], keep, merging, target, merge_budget, uniform
    )
    np.testing.assert_allclose(np.asarray(probability)[:, slots], fixture["probability"], 1e-6)
    np.testing.assert_allclose(np.asarray(merged)[:, keep], fixture["kept_values"], atol=1e-5)


def test_cam_accumulates_the_attention_of_decode_steps_only(monkeypatch):
    """CaM's cumulative attention (kvpress's running sum) starts at the first decode step: after
    t steps every head's tokens hold t in all (each step's probabilities sum to one), the
    prompt's own queries adding none."""
    from tests.test_sharding import CONFIG, sharded_test_prompts

    totals = []
    on_decode = cam.MergingDecodeEviction.on_decode

    def recording(self, kv, ctx):
        jax.debug.callback(lambda x: totals.append(np.asarray(x)), kv.token_scores().sum(-1))
        return on_decode(self, kv, ctx)

    monkeypatch.setattr(cam.MergingDecodeEviction, "on_decode", recording)
    model = init_model(CONFIG, seed=1, scale=0.3)
    policy = policies.get("cam", target_size=400, compression_interval=1)  # never over it
    jaxkv.generate(
        model, sharded_test_prompts()[:2], max_new_tokens=4, policy=policy, stop_tokens=[]
    )
    for step, total in enumerate(totals, start=1):  # [L, B, K] after `step` decode steps
        np.testing.assert_allclose(total, step, rtol=1e-5)
    assert len(totals) == 3  # the first token comes from the prefill's logits
