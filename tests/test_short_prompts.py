"""Every prompt is served (issue 70.4): a prompt (a row) shorter than what a policy compresses
around its windows, sinks or smallest budget is kept whole, and the outputs say so
(`GenerateOutput.compressed`, `Session.compressed`, the engine's first token, the CLI's
report); values wrong on every prompt are still refused before anything compiles. Every
registered policy is served by the engine (issue 75). And KVzip's replay of a prompt shorter
than its chunk is one chunk of the prompt's padded length (70.7)."""

import json

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import cli, policies
from jaxkv.gates import fastkvzip as fastkvzip_gates
from jaxkv.gates import wgkv as wgkv_gates
from jaxkv.models import init_model
from jaxkv.policies import kvzip
from jaxkv.sharding import make_inference_mesh
from tests.tiny_models import tiny_config

CONFIG = tiny_config()
SHORT = 20  # tokens: under every window, sink count and smallest budget of `KEPT_WHOLE`
LONG = 300
NEW_TOKENS = 8
KVZIP_IDS = dict(repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6))

KNORM_RECENT = policies.get("knorm", recent=32)

# Every registered policy, with options under which a 20-token prompt is too short to compress
# (the defaults where they are: SnapKV's 64-token window), and the prompt length where 20 is
# not short for it: GVote compresses any prompt of two tokens, DuoAttention picks its heads on
# any prompt longer than sinks + 1.
KEPT_WHOLE = {
    "full": ({}, SHORT),
    "streaming_llm": (dict(budget=0.3, recent=32), SHORT),
    "sliding_window": (dict(budget=0.3, recent=32), SHORT),
    "snapkv": (dict(budget=0.3), SHORT),
    "pyramidkv": (dict(budget=0.3), SHORT),
    "tova": (dict(budget=0.3, recent=32), SHORT),
    "knorm": (dict(budget=0.3, recent=32), SHORT),
    "expected_attention": (dict(budget=0.3, recent=32, future_positions=16), SHORT),
    "h2o": (dict(budget=0.3, recent=32, evict_every=4), SHORT),
    "observed_attention": (dict(budget=0.3, recent=32), SHORT),
    "adakv": (dict(budget=0.3), SHORT),
    "kvzip": (dict(budget=0.3, recent=32, **KVZIP_IDS), SHORT),
    "gvote": ({}, 1),
    "sage_kv": (dict(budget=0.1), SHORT),
    "confkv": (dict(tight=32, loose=48, protected=8, evict_every=4), SHORT),
    "scissorhands": (dict(budget=0.3, recent=32, evict_every=4), SHORT),
    "quest": (dict(budget=32), SHORT),
    "local_attention": (dict(window=32), SHORT),
    "wgkv": (dict(window=32, tau=0.5), SHORT),
    "duo_attention": (dict(window=32), 4),
    "fastkvzip": (dict(budget=0.4, window=32, decode_buffer=4), SHORT),
    "keydiff": (dict(budget=0.3, recent=32), SHORT),
    "lagkv": (dict(budget=0.3, recent=32), SHORT),
    "cur": (dict(budget=0.3, recent=32), SHORT),
    "random": (dict(budget=0.3, recent=32), SHORT),
    "chunkkv": (dict(budget=0.3), SHORT),
    "chunk": (dict(budget=0.3), 1),
    "block": (dict(budget=32), SHORT),
    "per_layer": (dict(budgets=(0.3,) * CONFIG.num_layers, inner=KNORM_RECENT), SHORT),
    "criticalkv": (dict(budget=0.3), SHORT),
    "critical_adakv": (dict(budget=0.3), SHORT),
    "decoding": (dict(target_size=32, compression_interval=4), SHORT),
    "cam": (dict(target_size=32, compression_interval=4), SHORT),
    "ratio_decoding": (dict(budget=0.3, compression_interval=512), SHORT),
    "dms": (dict(threshold=0.0, window=32), SHORT),
    "simlayerkv": (dict(lazy_threshold=0.0, n_recent=16), SHORT),
    "key_rerotation": (dict(budget=0.3, inner=KNORM_RECENT), SHORT),
    "merging": (dict(budget=0.3, inner=KNORM_RECENT), SHORT),
    "finch": (dict(budget=0.3), SHORT),
    "entropy_chunkkv": (dict(budget=0.3), 1),
    "cap": (dict(budget=0.3, recent=32), SHORT),
    "think": (dict(key_channel_ratio=0.5 / CONFIG.head_dim), SHORT),  # prunes no channel
    "qfilter": (dict(budget=0.3, recent=32), SHORT),
    "expected_attention_stats": (dict(budget=0.3, recent=32, future_positions=16), SHORT),
    "leverage": (dict(budget=0.3, recent=32), SHORT),
    "kvzap": (dict(budget=0.3, recent=32), SHORT),
    # Compresses any prompt (a layer may keep none of it): kept whole only at budget 1.
    "kvcompose": (dict(budget=1.0), SHORT),
    "kvgrad": (
        dict(budget=1.0, repeat_ids=(1, 2, 3), continue_ids=(4, 5, 6), suffix_ids=(7,)),
        SHORT,
    ),
    "noncausal_attention": (dict(budget=0.3, recent=32), SHORT),
    "compactor": (dict(budget=0.3), SHORT),  # 8 sinks + 4 recent: over 30% of 20
    "lukv": (dict(budget=1.0), SHORT),  # the curve sets every head's count: 1 keeps all
}


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, CONFIG.vocab_size, length).tolist()


def _policy_params(policy, model, prompt):
    """Fresh gates and filters for the learned policies; DuoAttention's heads picked on the
    prompt."""
    if policy.name == "wgkv":
        return wgkv_gates.init_write_gates(CONFIG, jax.random.PRNGKey(3))
    if policy.name == "fastkvzip":
        return fastkvzip_gates.init_params(CONFIG, jax.random.PRNGKey(4))
    if policy.name == "duo_attention":
        return policy.params.from_prompt(model, prompt)
    if policy.name in ("qfilter", "expected_attention_stats", "kvzap", "lukv"):
        return policy.params.init(CONFIG, jax.random.PRNGKey(5))
    return None


def _generate(model, prompts, policy, params=None, mesh=None):
    return jaxkv.generate(
        model,
        prompts,
        max_new_tokens=NEW_TOKENS,
        policy=policy,
        policy_params=params,
        stop_tokens=[],
        mesh=mesh,
    )


_FULL_CACHE_OUTPUTS: dict[int, jaxkv.GenerateOutput] = {}


def _full_cache_output(model, length: int):
    """The full cache's output on `_prompt(length)`, generated once per length (the model is
    the module's one)."""
    if length not in _FULL_CACHE_OUTPUTS:
        _FULL_CACHE_OUTPUTS[length] = _generate(model, [_prompt(length)], None)
    return _FULL_CACHE_OUTPUTS[length]


# Policies that keep a 300-token prompt whole too: they compress during decode only (CaM,
# DecodingPress, CompressionRatioDecodingPress), select pages without evicting (Quest), or
# under their `KEPT_WHOLE` options keep every token (a budget of 1, no channel pruned, GVote's
# votes covering every position of this random model).
COMPRESS_NOTHING = {
    "full",
    "cam",
    "decoding",
    "ratio_decoding",
    "quest",
    "kvcompose",
    "kvgrad",
    "lukv",
    "think",
    "gvote",
}


@pytest.mark.parametrize("name", policies.registered())
def test_every_policy_serves_a_short_prompt_whole_beside_a_long_one_in_the_engine(model, name):
    """Each registered policy runs in the engine (issue 75: every press served there): the short
    prompt, prefilled in the same step as a long one, is kept whole and answers as the full
    cache; the long one is compressed. The engine reads `generate`'s chunks and runs its
    compression and decode step (issue 71), so this is `generate`'s behaviour too."""
    options, length = KEPT_WHOLE[name]  # a KeyError for a policy registered since
    policy = policies.get(name, **options)
    short, long = _prompt(length), _prompt(LONG, seed=2)
    params = _policy_params(policy, model, long)  # DuoAttention's heads picked on the long one
    engine = jaxkv.Engine(
        model,
        policy,
        cache=jaxkv.CacheConfig(num_pages=512),
        max_slots=2,
        max_prefills=2,
        policy_params=params,
    )
    ids = [engine.submit(p, max_new_tokens=NEW_TOKENS, stop_tokens=[]) for p in (short, long)]
    events = list(engine.stream())
    first = {event.request_id: event for event in reversed(events)}
    assert first[ids[0]].compressed is False
    assert first[ids[1]].compressed is (name not in COMPRESS_NOTHING)
    assert sum(event.compressed is not None for event in events) == 2  # first tokens only
    tokens = [event.token for event in events if event.request_id == ids[0]]
    full = _full_cache_output(model, length)
    np.testing.assert_array_equal(tokens, full.tokens[0, :NEW_TOKENS])
    np.testing.assert_array_equal(full.compressed, [False])


# A policy of each kind of prompt-dependent check: the observation window (SnapKV, PyramidKV,
# AdaKV), sinks + recent window with a decode eviction (StreamingLLM), SAGE-KV's smallest split,
# KVzip's recent window, Fast KVzip's protected window.
RAGGED = {
    "snapkv": dict(budget=0.3),
    "pyramidkv": dict(budget=0.3),
    "adakv": dict(budget=0.3),
    "streaming_llm": dict(budget=0.3, recent=64, evict_every=4),
    "sage_kv": dict(budget=0.1),
    "kvzip": dict(budget=0.3, recent=64, **KVZIP_IDS),
    "fastkvzip": dict(budget=0.3, window=64),
}


def _sorted_positions(state, row: int) -> np.ndarray:
    """int [L, K, S]: the positions each head of `row` holds, sorted (-1s first)."""
    return np.sort(np.asarray(state.positions())[:, row], axis=-1)


@pytest.mark.parametrize("name", sorted(RAGGED))
def test_a_ragged_batch_keeps_its_short_row_whole_and_its_long_row_as_alone(model, name):
    policy = policies.get(name, **RAGGED[name])
    short, long = _prompt(SHORT, seed=1), _prompt(LONG, seed=2)
    params = _policy_params(policy, model, long)
    cache = jaxkv.CacheConfig(page_size=8)
    batch = jaxkv.prefill(model, [short, long], policy, cache=cache, policy_params=params)
    alone = jaxkv.prefill(model, [long], policy, cache=cache, policy_params=params)
    np.testing.assert_array_equal(batch.compressed(), [False, True])
    np.testing.assert_array_equal(alone.compressed(), [True])
    held = _sorted_positions(batch.kv, 0)
    assert np.all(held[..., -SHORT:] == np.arange(SHORT)) and np.all(held[..., :-SHORT] == -1)
    kept = _sorted_positions(batch.kv, 1)
    kept_alone = _sorted_positions(alone.kv, 0)
    width = min(kept.shape[-1], kept_alone.shape[-1])
    np.testing.assert_array_equal(kept[..., -width:], kept_alone[..., -width:])
    out = jaxkv.decode(batch, NEW_TOKENS, stop_tokens=[])
    out_alone = jaxkv.decode(alone, NEW_TOKENS, stop_tokens=[])
    np.testing.assert_array_equal(out.tokens[1], out_alone.tokens[0])
    np.testing.assert_array_equal(out.compressed, [False, True])


def test_the_flag_on_a_mesh_equals_one_devices(model):
    prompts = [_prompt(SHORT, seed=1), _prompt(LONG, seed=2)]
    mesh = make_inference_mesh(data=2, model=2)
    one = _generate(model, prompts, "snapkv:0.3")
    sharded = _generate(model, prompts, "snapkv:0.3", mesh=mesh)
    np.testing.assert_array_equal(sharded.compressed, [False, True])
    np.testing.assert_array_equal(sharded.tokens, one.tokens)


def test_the_cli_report_says_whether_the_prompt_was_compressed(capsys):
    argv = ["generate", "--model", "tiny-random", "--max-new-tokens", "2", "--policy", "snapkv"]
    for budget, prompt, compressed in (("0.3", "short", False), ("0.5", "x" * 200, True)):
        assert cli.main([*argv, "--budget", budget, "--prompt", prompt]) == 0
        out = capsys.readouterr().out
        report = json.loads(out[out.index('{\n  "model"') :])
        assert report["prompt_compressed"] is compressed


@pytest.mark.parametrize(
    ("policy", "length", "match"),
    [
        # Token budgets below what each head protects: wrong on every prompt, short ones too.
        (
            policies.SnapKV(budget=40),
            30,
            r"budget of 40 tokens is smaller than the 64 tokens each head protects .*"
            r"give budget >= 64 tokens",
        ),
        (
            policies.StreamingLLM(budget=3),
            2,
            r"budget of 3 tokens is smaller than the 4 tokens each head protects",
        ),
        (
            policies.AdaKV(budget=3, inner="streaming_llm"),
            200,
            r"'adakv': budget of 3 tokens is smaller than the 4 tokens",
        ),
        (policies.SageKV(budget=3), 2, "budget of 3 tokens is below 4: give budget >= 4 tokens"),
    ],
)
def test_values_wrong_on_every_prompt_are_refused_before_compiling(model, policy, length, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.compress_prompt(model, [_prompt(length)], policy)


def test_kvzip_replays_a_short_prompt_in_one_chunk_of_its_padded_length(model, monkeypatch):
    chunks = []
    scores = kvzip.reconstruction_scores

    def recorded(*args, chunk, **kwargs):
        chunks.append(chunk)
        return scores(*args, chunk=chunk, **kwargs)

    monkeypatch.setattr(kvzip, "reconstruction_scores", recorded)
    jax.clear_caches()
    jaxkv.compress_prompt(model, [_prompt(31)], policies.KVzip(ratio=0.3, **KVZIP_IDS))
    assert chunks == [32]  # the prompt's padded length, not the 512-token chunk
