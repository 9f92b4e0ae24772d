"""Writes the kvpress fixtures of `tests/test_kvpress_presses.py`: what kvpress 0.5.5's presses
keep on small random Llama and Qwen3 models, for jaxkv's presses to be compared with.

Runs in kvpress's own environment (kvpress pins transformers < 5.3; see
`jaxkv/benchmarks/kvpress_reference.py`):

    python -m venv .venv-kvpress && . .venv-kvpress/bin/activate && pip install -e '.[kvpress]'
    python tests/kvpress_presses/write_fixtures.py

For each model (written here as a Hugging Face directory, `MODEL/`, which the test loads with
jaxkv's own loader) one prompt of distinct random tokens is prefilled under each press of
`CASES`; `MODEL/PRESS.npz` holds, per layer, the positions each KV head kept (`kept`, int
[L, K, n], -1 past a layer's count) and, for presses that score tokens, kvpress's scores of
every position (`scores`, f32 [L, K, T]: the test accepts any choice among tokens tied at the
cut). `fixtures.json` records the command, the commit, the machine and the versions.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path

import kvpress
import numpy as np
import torch
import transformers
from kvpress.presses import kvzip_press
from transformers import DynamicCache

HERE = Path(__file__).resolve().parent
PROMPT_TOKENS = 203
SEED = 0

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)

MODELS = {
    "llama": (transformers.LlamaConfig, dict(_COMMON, rope_theta=10000.0)),
    "qwen3": (transformers.Qwen3Config, dict(_COMMON, rope_theta=1000000.0)),
}

QUESTION_TOKENS = 24  # the prompt's last tokens, FINCH's question


def finch(**kwargs):
    """A FinchPress whose question is the prompt's last QUESTION_TOKENS (kvpress finds it by a
    delimiter token; a delimiter id absent from the prompt leaves the window as set)."""
    press = kvpress.FinchPress(**kwargs)
    press.window_size = QUESTION_TOKENS
    press.delimiter_token_id = 0  # the prompt's ids start at 3
    return press


# name: (kvpress press, the jaxkv spec that should keep the same positions)
CASES = {
    "knorm": (lambda: kvpress.KnormPress(compression_ratio=0.5), "knorm:0.5"),
    # the query statistics read from the prompt itself (ExpectedAttentionStats is given them)
    "expected_attention": (
        lambda: kvpress.ExpectedAttentionPress(compression_ratio=0.5),
        "expected_attention:0.5",
    ),
    "expected_attention-0.25": (
        lambda: kvpress.ExpectedAttentionPress(compression_ratio=0.75),
        "expected_attention:0.25",
    ),
    "keydiff": (lambda: kvpress.KeyDiffPress(compression_ratio=0.5), "keydiff:0.5"),
    "keydiff-0.25": (lambda: kvpress.KeyDiffPress(compression_ratio=0.75), "keydiff:0.25"),
    "lagkv": (
        lambda: kvpress.LagKVPress(compression_ratio=0.5, n_sink=4, lag_size=16),
        "lagkv:0.5:lag_size=16",
    ),
    "lagkv-cross": (
        lambda: kvpress.LagKVPress(compression_ratio=0.6, lag_size=32, cross_scoring=True),
        "lagkv:0.4:lag_size=32:cross_scoring=true",
    ),
    "lagkv-short": (
        lambda: kvpress.LagKVPress(compression_ratio=0.5, lag_size=128),
        "lagkv:0.5",
    ),
    "snapkv": (lambda: kvpress.SnapKVPress(compression_ratio=0.5), "snapkv:0.5"),
    "pyramidkv": (lambda: kvpress.PyramidKVPress(compression_ratio=0.5), "pyramidkv:0.5"),
    "pyramidkv-0.33": (  # no pyramid fits: every layer keeps round(0.33 T) = 67, not 66
        lambda: kvpress.PyramidKVPress(compression_ratio=0.67),
        "pyramidkv:0.33",
    ),
    "pyramidkv-beta4": (
        lambda: kvpress.PyramidKVPress(compression_ratio=0.3, window_size=8, beta=4),
        "pyramidkv:0.7:window=8:beta=4",
    ),
    "cur": (lambda: kvpress.CURPress(compression_ratio=0.5), "cur:0.5"),
    "cur-key": (
        lambda: kvpress.CURPress(
            compression_ratio=0.7, leverage_type="key", use_local_approximation=False
        ),
        "cur:0.3:leverage_type=key:local_window=0",
    ),
    "cur-kv_avg": (
        lambda: kvpress.CURPress(
            compression_ratio=0.5, leverage_type="kv_avg", local_window_size=8, num_sinks=2
        ),
        "cur:0.5:leverage_type=kv_avg:local_window=8:sinks=2",
    ),
    "chunkkv-knorm": (
        lambda: kvpress.ChunkKVPress(kvpress.KnormPress(compression_ratio=0.5), chunk_length=20),
        "chunkkv:0.5:inner=knorm:chunk_length=20",
    ),
    "chunkkv-snapkv": (
        lambda: kvpress.ChunkKVPress(kvpress.SnapKVPress(compression_ratio=0.5), chunk_length=20),
        "chunkkv:0.5:inner=snapkv",
    ),
    "chunkkv-keydiff": (
        lambda: kvpress.ChunkKVPress(kvpress.KeyDiffPress(compression_ratio=0.7), chunk_length=8),
        "chunkkv:0.3:inner=keydiff:chunk_length=8",
    ),
    "chunk-keydiff": (
        lambda: kvpress.ChunkPress(kvpress.KeyDiffPress(compression_ratio=0.5), chunk_length=64),
        "chunk:0.5:inner=keydiff:chunk_length=64",
    ),
    "chunk-cur": (
        lambda: kvpress.ChunkPress(kvpress.CURPress(compression_ratio=0.6), chunk_length=50),
        "chunk:0.4:inner=cur:chunk_length=50",
    ),
    "adakv": (lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.5)), "adakv:0.5"),
    "adakv-pyramidkv": (  # a wrapper reads PyramidKV's scores alone
        lambda: kvpress.AdaKVPress(kvpress.PyramidKVPress(compression_ratio=0.5)),
        "adakv:0.5:inner=pyramidkv",
    ),
    "criticalkv-snapkv": (
        lambda: kvpress.CriticalKVPress(kvpress.SnapKVPress(compression_ratio=0.5)),
        "criticalkv:0.5:inner=snapkv",
    ),
    "criticalkv-keydiff": (
        lambda: kvpress.CriticalKVPress(
            kvpress.KeyDiffPress(compression_ratio=0.6), first_stage_ratio=0.3
        ),
        "criticalkv:0.4:inner=keydiff:first_stage=0.3",
    ),
    "critical_adakv-snapkv": (
        lambda: kvpress.CriticalAdaKVPress(kvpress.SnapKVPress(compression_ratio=0.5)),
        "critical_adakv:0.5:inner=snapkv",
    ),
    "critical_adakv-knorm": (
        lambda: kvpress.CriticalAdaKVPress(
            kvpress.KnormPress(compression_ratio=0.7), alpha_safeguard=0.4
        ),
        "critical_adakv:0.3:inner=knorm:safeguard=0.4",
    ),
    "per_layer-knorm": (
        lambda: kvpress.PerLayerCompressionPress(
            kvpress.KnormPress(), compression_ratios=[0.3, 0.7]
        ),
        "per_layer:0.7,0.3:inner=knorm",
    ),
    "per_layer-snapkv": (
        lambda: kvpress.PerLayerCompressionPress(
            kvpress.SnapKVPress(), compression_ratios=[0.5, 0.6]
        ),
        "per_layer:0.5,0.4:inner=snapkv",
    ),
    "simlayerkv-0.305": (
        lambda: kvpress.SimLayerKVPress(lazy_threshold=0.305, n_recent=64),
        "simlayerkv:0.305:n_recent=64",
    ),
    "simlayerkv-0.335": (
        lambda: kvpress.SimLayerKVPress(lazy_threshold=0.335, n_recent=64),
        "simlayerkv:0.335:n_recent=64",
    ),
    "simlayerkv-last4": (
        lambda: kvpress.SimLayerKVPress(lazy_threshold=0.2, n_last=4, n_recent=48, n_initial=2),
        "simlayerkv:0.2:n_last=4:n_recent=48:n_initial=2",
    ),
    "entropy_chunkkv-snapkv": (
        lambda: kvpress.EntropyGatedChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=0.5)),
        "entropy_chunkkv:0.5",
    ),
    "entropy_chunkkv-knorm": (
        lambda: kvpress.EntropyGatedChunkKVPress(
            press=kvpress.KnormPress(compression_ratio=0.7),
            chunk_length=12,
            low_entropy_chunk_length=3,
        ),
        "entropy_chunkkv:0.3:inner=knorm:chunk_length=12:low_entropy_length=3",
    ),
    "cap": (lambda: kvpress.CapPress(compression_ratio=0.5), "cap:0.5"),
    "cap-tau2": (
        lambda: kvpress.CapPress(compression_ratio=0.7, tau=2.0, n_future_positions=64, n_sink=2),
        "cap:0.3:tau=2.0:future_positions=64:sinks=2",
    ),
    "finch-kept": (
        lambda: finch(compression_ratio=0.5, rerotate_keys=False),
        f"finch:0.5:window={QUESTION_TOKENS}:rerotate_keys=false",
    ),
    "finch-unnormalized-kept": (
        lambda: finch(compression_ratio=0.7, rerotate_keys=False, normalize_scores=False),
        f"finch:0.3:window={QUESTION_TOKENS}:rerotate_keys=false:normalize_scores=false",
    ),
    "dms-knorm": (
        lambda: kvpress.DMSPress(kvpress.KnormPress(), threshold=-2.7, sliding_window_size=32),
        "dms:-2.7:window=32",
    ),
    "dms-knorm-4": (
        lambda: kvpress.DMSPress(kvpress.KnormPress(), threshold=-4.0, sliding_window_size=50),
        "dms:-4.0:window=50",
    ),
    "block-keydiff": (
        lambda: kvpress.BlockPress(kvpress.KeyDiffPress(compression_ratio=0.5), block_size=32),
        "block:0.5:inner=keydiff:block_size=32",
    ),
    "block-knorm": (
        lambda: kvpress.BlockPress(kvpress.KnormPress(compression_ratio=0.75), block_size=16),
        "block:0.25:inner=knorm:block_size=16",
    ),
    "noncausal": (
        lambda: kvpress.NonCausalAttnPress(compression_ratio=0.5, chunk_size=64),
        "noncausal_attention:0.5:block_size=64",
    ),
    "noncausal-256": (
        lambda: kvpress.NonCausalAttnPress(compression_ratio=0.7),
        "noncausal_attention:0.3",
    ),
    "kvcompose": (lambda: kvpress.KVComposePress(compression_ratio=0.5), "kvcompose:0.5"),
    "kvcompose-unstructured": (
        lambda: kvpress.KVComposePress(structured=False, compression_ratio=0.75),
        "kvcompose:0.25:structured=false",
    ),
    "kvcompose-mean-max": (
        lambda: kvpress.KVComposePress(
            compression_ratio=0.6,
            agg_task="mean",
            agg_group="max",
            agg_head="max",
            add_mean_across_heads=False,
            keep_token_lower_bound=16,
        ),
        "kvcompose:0.4:task=mean:group=max:aggregate_heads=max:mean_across_heads=false"
        ":lower_bound=16",
    ),
    # The replay presses read their prompts through a byte-level stand-in tokenizer
    # (`ByteTokenizer`): jaxkv's byte-level defaults are the same ids.
    "kvgrad-chunks": (
        lambda: kvpress.KVgradPress(compression_ratio=0.5, chunk_size=64),
        "kvgrad:0.5:chunk=64",
    ),
    "kvgrad": (lambda: kvpress.KVgradPress(compression_ratio=0.7), "kvgrad:0.3"),
    # KVzip as the paper's code scores (sinks=4, the request in the context's turn): jaxkv's
    # kvzip with those options. 101 of the prompt's 203 tokens evicted: kvpress's kept count
    # (all pairs less int(pairs x ratio)) and jaxkv's (floor(share x 203) a head) agree.
    "kvzip-chunks": (
        lambda: kvpress.KVzipPress(compression_ratio=101 / 203, chunk_size=64),
        "kvzip:0.5024630541871922:chunk=64:sinks=4:prompt_turn=context",
    ),
    "kvzip": (
        lambda: kvpress.KVzipPress(compression_ratio=101 / 203),
        "kvzip:0.5024630541871922:sinks=4:prompt_turn=context",
    ),
}

# name: (kvpress press, jaxkv spec): presses that zero key channels and keep every token;
# `MODEL/CASE.npz` holds `zeroed`, bool [L, K, H], the channels zero in every key of a head.
CHANNEL_CASES = {
    "think-0.5": (
        lambda: kvpress.ThinKPress(key_channel_compression_ratio=0.5),
        "think:0.5",
    ),
    "think-0.3-window8": (
        lambda: kvpress.ThinKPress(key_channel_compression_ratio=0.3, window_size=8),
        "think:0.3:window=8",
    ),
}

# name: (kvpress press, jaxkv spec, the case in CASES keeping the same positions, decode
# steps): presses that rotate the kept keys. `MODEL/CASE.npz` holds the cache's keys after the
# prompt (`keys`, [L, K, n, H], in position order) and the greedy tokens after it (`tokens`).
ROTATION_CASES = {
    "key_rerotation-knorm": (
        lambda: kvpress.KeyRerotationPress(kvpress.KnormPress(compression_ratio=0.5)),
        "key_rerotation:0.5",
        "knorm",
        6,
    ),
    "finch": (
        lambda: finch(compression_ratio=0.5),
        f"finch:0.5:window={QUESTION_TOKENS}",
        "finch-kept",
        6,
    ),
    "key_rerotation-pyramidkv": (  # PyramidKV's scores, SnapKV's uniform budgets
        lambda: kvpress.KeyRerotationPress(kvpress.PyramidKVPress(compression_ratio=0.5)),
        "key_rerotation:0.5:inner=pyramidkv",
        "snapkv",
        6,
    ),
    "key_rerotation-keydiff": (
        lambda: kvpress.KeyRerotationPress(kvpress.KeyDiffPress(compression_ratio=0.75)),
        "key_rerotation:0.25:inner=keydiff",
        "keydiff-0.25",
        6,
    ),
}

# name: (kvpress press, jaxkv spec): presses that merge evicted values into kept ones.
# `MODEL/CASE.npz` holds `kept` (as CASES) and the kept tokens' values after merging
# (`values`, [L, K, n, H], in `kept`'s order).
MERGE_CASES = {
    "merging-knorm": (
        lambda: kvpress.MergingPress(press=kvpress.KnormPress(compression_ratio=0.5)),
        "merging:0.5",
    ),
    "merging-keydiff-gated": (
        lambda: kvpress.MergingPress(
            press=kvpress.KeyDiffPress(compression_ratio=0.7),
            similarity_threshold=0.2,
            merge_fraction=0.75,
        ),
        "merging:0.3:inner=keydiff:similarity_threshold=0.2:merge_fraction=0.75",
    ),
}

# CAMPress's compression of one layer, called directly on random keys, values and cumulative
# attentions: (slots, KV heads, head dim, target_size, compression_interval, merge_budget).
# `cam/CASE.npz` holds the inputs, Knorm's scores, the merge probabilities and masks kvpress drew
# (torch.bernoulli recorded) and the keys and values it kept.
CAM_CASES = {
    "cam-window4": (48, 2, 16, 32, 8, 4),
    "cam-window32": (96, 3, 8, 40, 40, 32),
}


def cam_fixture(slots, heads, dim, target, interval, merge_budget) -> dict[str, np.ndarray]:
    """Inputs and outputs of CAMPress.compress on one layer (CAM_CASES)."""
    generator = torch.Generator().manual_seed(slots)
    keys = torch.randn(1, heads, slots, dim, generator=generator)
    values = torch.randn(1, heads, slots, dim, generator=generator)
    attention = torch.rand(1, heads, slots, generator=generator) * 3.0
    attention[..., ::7] = 0.0  # tokens no decode query attended to (0 / 0 windows too)
    press = kvpress.CAMPress(
        base_press=kvpress.KnormPress(),
        compression_interval=interval,
        target_size=target,
        merge_budget=merge_budget,
    )
    module = torch.nn.Module()
    module.layer_idx = 0
    press.layer_step_counts[0] = interval
    press._running_attn_sum[0] = attention.clone()
    drawn = []
    bernoulli = torch.bernoulli

    def recording_bernoulli(probability, *args, **kwargs):
        mask = bernoulli(probability, *args, **kwargs)
        drawn.append((probability.clone(), mask.clone()))
        return mask

    torch.bernoulli = recording_bernoulli
    try:
        scores = press.base_press.score(module, None, keys, values, None, {})
        kept_keys, kept_values = press.compress(module, None, keys, values.clone(), attention, {})
    finally:
        torch.bernoulli = bernoulli
    ((probability, mask),) = drawn
    return {
        "keys": keys[0].numpy(),
        "values": values[0].numpy(),
        "attention": attention[0].numpy(),
        "scores": scores[0].numpy(),
        "probability": probability[0].numpy(),
        "mask": mask[0].numpy(),
        "kept_keys": kept_keys[0].numpy(),
        "kept_values": kept_values[0].numpy(),
        "settings": np.array([target, interval, merge_budget]),
    }


# Presses that compress during generation: (press, jaxkv spec, greedy decode steps). The fixture
# holds the generated tokens too (`tokens`), and the positions kept at the end.
DECODING_CASES = {
    "decoding-knorm": (
        lambda: kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=8, target_size=64),
        "decoding:64:inner=knorm:compression_interval=8",
        20,
    ),
    "decoding-keydiff": (
        lambda: kvpress.DecodingPress(
            kvpress.KeyDiffPress(), compression_interval=5, target_size=150
        ),
        "decoding:150:inner=keydiff:compression_interval=5",
        12,
    ),
    "ratio_decoding-knorm": (
        lambda: kvpress.CompressionRatioDecodingPress(
            kvpress.KnormPress(), target_compression_ratio=0.6, compression_interval=7
        ),
        "ratio_decoding:0.4:inner=knorm:compression_interval=7",
        15,
    ),
    "dms-decoding": (
        lambda: kvpress.DMSPress(
            kvpress.KnormPress(), threshold=-2.7, sliding_window_size=16, decoding=True
        ),
        "dms:-2.7:window=16:decoding=true",
        24,
    ),
    "dms-decoding-4": (
        lambda: kvpress.DMSPress(
            kvpress.KnormPress(), threshold=-4.0, sliding_window_size=16, decoding=True
        ),
        "dms:-4.0:window=16:decoding=true",
        24,
    ),
    "prefill_decoding": (
        lambda: kvpress.PrefillDecodingPress(
            kvpress.KnormPress(compression_ratio=0.5),
            kvpress.DecodingPress(kvpress.KeyDiffPress(), compression_interval=6, target_size=80),
        ),
        "knorm:0.5+decoding:80:inner=keydiff:compression_interval=6",
        13,
    ),
}

# name: (kvpress compression ratio, jaxkv spec): QFilterPress with filters given here (kvpress
# reads them from the Hugging Face hub, which has none for these models): seeded random f32
# [L, K, H] filters, saved in `MODEL/CASE.npz` as `filters` beside `kept` and `scores`.
FILTER_CASES = {
    "qfilter-0.5": (0.5, "qfilter:0.5"),
    "qfilter-0.2": (0.8, "qfilter:0.2"),
}
# name: (kvpress compression ratio, jaxkv spec): ExpectedAttentionStatsPress with statistics
# given here (kvpress reads them from the hub): a seeded random query mean f32 [L, N, H] and
# covariance A A^T / H [L, N, H, H], saved as `query_mean`, `query_covariance`.
STATS_CASES = {
    "expected_attention_stats-0.5": (0.5, "expected_attention_stats:0.5"),
    "expected_attention_stats-0.25": (0.75, "expected_attention_stats:0.25"),
}

# name: (kvpress press, jaxkv spec): LeverageScorePress and CompactorPress, whose Gaussian
# sketches (torch.randn) are recorded: `MODEL/CASE.npz` holds `sketch` f32 [L, K, H, k] beside
# `kept` and `scores`.
SKETCH_CASES = {
    "leverage-0.5": (lambda: kvpress.LeverageScorePress(compression_ratio=0.5), "leverage:0.5"),
    "leverage-0.25-k8": (
        lambda: kvpress.LeverageScorePress(compression_ratio=0.75, sketch_dimension=8),
        "leverage:0.25:sketch_dimension=8",
    ),
    # kvpress blends with its compression ratio; jaxkv's default blends with the kept share.
    "compactor-0.5": (
        lambda: kvpress.CompactorPress(compression_ratio=0.5),
        "compactor:0.5:blending=0.5",
    ),
    "compactor-0.3-blocks": (
        lambda: kvpress.CompactorPress(compression_ratio=0.7, chunk_size=64, blending=0.2),
        "compactor:0.3:block_size=64:blending=0.2",
    ),
    "compactor-0.4-sinks": (
        lambda: kvpress.CompactorPress(
            compression_ratio=0.6, sink_size_start=4, sink_size_end=16, sketch_dimension=8
        ),
        "compactor:0.4:sinks=4:recent=16:sketch_dimension=8:blending=0.6",
    ),
}

# name: (kvpress compression ratio, surrogate, jaxkv spec): KVzapPress with surrogates given
# here (kvpress reads NVIDIA's from the hub, which has none for these models): seeded random
# weights, saved in jaxkv's layout (weight [L, D, K], ...) beside `kept` and `scores`.
# name: (kvpress LUKVPress, jaxkv spec), given a random budget curve (`curve_cases`);
# `MODEL/CASE.npz` holds it as jaxkv's `prune_shares` [L, 99, K] and the inner press's scores.
CURVE_CASES = {
    "lukv-0.5": (lambda: kvpress.LUKVPress(compression_ratio=0.5), "lukv:0.5"),
    "lukv-knorm-0.3": (
        lambda: kvpress.LUKVPress(kvpress.KnormPress(), compression_ratio=0.7, sink=2, window=8),
        "lukv:0.3:inner=knorm:sinks=2:window=8",
    ),
}

SURROGATE_CASES = {
    "kvzap-mlp-0.5": (0.5, "mlp", "kvzap:0.5"),
    "kvzap-linear-0.3": (0.7, "linear", "kvzap:0.3:surrogate=linear"),
}
SURROGATE_HIDDEN = 12


def surrogate_weights(rng, surrogate: str, layers: int, d: int, k: int) -> dict:
    """Seeded random surrogate weights in jaxkv's layout (`jaxkv.policies.kvzap.AXES`)."""
    m = SURROGATE_HIDDEN
    shapes = {
        "linear": {"weight": (layers, d, k), "bias": (layers, k)},
        "mlp": {
            "w_in": (layers, d, m),
            "b_in": (layers, m),
            "w_out": (layers, m, k),
            "b_out": (layers, k),
        },
    }[surrogate]
    return {
        name: (0.5 * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in shapes.items()
    }


def given_surrogate(ratio: float, surrogate: str, weights: dict):
    """A KVzapPress whose surrogates are `weights` instead of NVIDIA's from the hub."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    def linear(module, weight, bias):  # jaxkv's [in, out] -> torch's [out, in]
        module.weight.data = torch.tensor(weight.T.copy())
        module.bias.data = torch.tensor(bias)

    @dataclasses.dataclass
    class GivenSurrogate(kvpress.KVzapPress):
        def post_init_from_model(self, model):
            layers, d = model.config.num_hidden_layers, model.config.hidden_size
            config = KVzapConfig(
                input_dim=d,
                output_dim=model.config.num_key_value_heads,
                n_modules=layers,
                hidden_dim=SURROGATE_HIDDEN if surrogate == "mlp" else None,
            )
            self.kvzap_model = KVzapModel(config)
            for i, module in enumerate(self.kvzap_model.layers):
                if surrogate == "linear":
                    linear(module, weights["weight"][i], weights["bias"][i])
                else:
                    linear(module[0], weights["w_in"][i], weights["b_in"][i])
                    linear(module[2], weights["w_out"][i], weights["b_out"][i])

    return GivenSurrogate(compression_ratio=ratio, model_type=surrogate)


def scored_fixture(model, ids, full: DynamicCache, press) -> dict[str, np.ndarray]:
    """`kept` and `scores` (`recorded_scores`) of a scoring press prefilling `ids`."""
    scores = recorded_scores(press)
    cache = prefill(model, ids, press)
    kept = [
        kept_positions(full.layers[layer].keys, cache.layers[layer].keys)
        for layer in range(len(cache.layers))
    ]
    return {"kept": padded(kept), "scores": np.stack([scores[i] for i in sorted(scores)])}


def recording_randn(drawn: list):
    """torch.randn, recording what it draws in `drawn`."""
    original = torch.randn

    def randn(*args, **kwargs):
        sample = original(*args, **kwargs)
        drawn.append(sample.detach().clone())
        return sample

    return original, randn


def given_statistics(ratio: float, mean: np.ndarray, covariance: np.ndarray):
    """An ExpectedAttentionStatsPress that uses `mean` and `covariance` instead of loading the
    model's from the hub."""

    @dataclasses.dataclass
    class GivenStatistics(kvpress.ExpectedAttentionStatsPress):
        def post_init_from_model(self, model):
            self.mu = torch.tensor(mean, dtype=model.dtype)
            self.cov = torch.tensor(covariance, dtype=model.dtype)

    return GivenStatistics(compression_ratio=ratio)


def given_curve(make_press, curve: np.ndarray):
    """An LUKVPress (`make_press()`) that uses `curve` ([99, L, K]) instead of downloading
    Llama-3.1-8B's."""
    press = make_press()
    press._budget_curves = curve
    return press


def given_filters(ratio: float, filters: np.ndarray):
    """A QFilterPress that uses `filters` instead of loading the model's from the hub."""

    @dataclasses.dataclass
    class GivenFilters(kvpress.QFilterPress):
        def post_init_from_model(self, model):
            self.q_filters = torch.tensor(filters, dtype=model.dtype)

    return GivenFilters(compression_ratio=ratio)


class ByteTokenizer:
    """What KVzipPress and KVgradPress read from the model's tokenizer (they load it by the
    model's name, which a random model has not): no chat template, UTF-8 bytes as ids."""

    chat_template = None

    def encode(self, text: str, return_tensors=None, add_special_tokens=False) -> torch.Tensor:
        del return_tensors, add_special_tokens
        return torch.tensor([list(text.encode())])

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> ByteTokenizer:
        return cls()


def recorded_replay_scores(press) -> dict[int, np.ndarray]:
    """Wraps a replay press's `compress_post` to record its scores of every layer, sinks
    raised above the rest (`score_val`, [L, 1, K, T]), before it evicts."""
    scores: dict[int, np.ndarray] = {}
    original = press.compress_post

    def compress_post(model):
        out = original(model)
        for layer, layer_scores in enumerate(press.score_val.float().numpy()):
            scores[layer] = layer_scores[0]
        return out

    press.compress_post = compress_post
    return scores


def build_model(name: str, directory: Path) -> transformers.PreTrainedModel:
    """A random fp32 model (norms near 1, weights of std 0.08), saved to `directory`."""
    config_cls, kwargs = MODELS[name]
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**kwargs), attn_implementation="sdpa", dtype=torch.float32
    )
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(directory)
    return model


def prefill(model, ids: torch.Tensor, press=None) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model(ids, past_key_values=cache)
        else:
            with press(model):
                model(ids, past_key_values=cache)
    return cache


def eager_prefill(model, ids: torch.Tensor) -> DynamicCache:
    """The cache of `prefill` under eager attention, which KVComposePress switches the model to
    (its keys past the first layer differ from sdpa's in the last bits)."""
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        return prefill(model, ids)
    finally:
        model.config._attn_implementation = implementation


def recorded_scores(press) -> dict[int, np.ndarray]:
    """Wraps the press's `score` (a scoring press's own) to record each layer's scores."""
    scores: dict[int, np.ndarray] = {}
    original = press.score

    def score(module, *args, **kwargs):
        out = original(module, *args, **kwargs)
        scores[module.layer_idx] = out[0].float().numpy()
        return out

    press.score = score
    return scores


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
    """int [K, n]: the position of each kept key (rows of `kept` [1, K, n, H] found in
    `full` [1, K, T, H], by exact equality: a press gathers, it does not compute)."""
    heads = []
    for head in range(full.shape[1]):
        equal = (kept[0, head][:, None, :] == full[0, head][None, :, :]).all(-1)  # [n, T]
        if not bool((equal.sum(-1) == 1).all()):
            raise RuntimeError("a kept key matches no position, or several")
        heads.append(equal.int().argmax(-1).numpy())
    return np.stack(heads)


def attention_modules(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def unmasked_positions(masked, full: torch.Tensor) -> list[np.ndarray]:
    """[K] the positions a head-wise press (AdaKV, CriticalAdaKV) left unmasked: kvpress keeps
    every key and masks the evicted ones (`module.masked_key_indices`) in attention."""
    _, heads, positions = (index.numpy() for index in masked)
    length = full.shape[2]
    return [
        np.setdiff1d(np.arange(length), positions[heads == head]) for head in range(full.shape[1])
    ]


def padded(per_layer: list) -> np.ndarray:
    """int [L, K, n]: each layer's and head's kept positions, -1 after its last (ChunkKV's
    layers and AdaKV's heads keep different counts)."""
    width = max(len(head) for kept in per_layer for head in kept)
    out = np.full((len(per_layer), len(per_layer[0]), width), -1, np.int64)
    for layer, kept in enumerate(per_layer):
        for head, positions in enumerate(kept):
            out[layer, head, : len(positions)] = positions
    return out


class PositionTracker:
    """The position of every key a press's cache holds, through its compressions: each
    `compress` of the wrapped presses maps the keys it keeps back to the keys it was given
    (kvpress's cache holds them in the order its scorer ranked them), and the keys written in
    between take the next positions."""

    def __init__(self, *presses):
        self.positions: dict[int, np.ndarray] = {}  # layer -> int [K, n]
        self.seen: dict[int, int] = {}  # layer -> keys written so far
        for press in presses:
            self._wrap(press)

    def _wrap(self, press) -> None:
        original = press.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            layer = module.layer_idx
            self.extend(layer, keys.shape[1], keys.shape[2])
            kept_keys, kept_values = original(
                module, hidden_states, keys, values, attentions, kwargs
            )
            chosen = kept_positions(keys, kept_keys)  # [K, n] indices into the cache given
            self.positions[layer] = np.take_along_axis(self.positions[layer], chosen, axis=1)
            return kept_keys, kept_values

        press.compress = compress

    def extend(self, layer: int, heads: int, length: int) -> None:
        """Positions for the keys written since the last compression (length: the cache's)."""
        held = self.positions.get(layer, np.zeros((heads, 0), np.int64))
        seen = self.seen.get(layer, 0)
        new = np.arange(seen, seen + length - held.shape[1])
        self.positions[layer] = np.concatenate([held, np.broadcast_to(new, (heads, len(new)))], 1)
        self.seen[layer] = seen + len(new)


def decoded(model, ids: torch.Tensor, press, steps: int):
    """kvpress's pipeline's greedy loop (explicit position ids): the prompt prefilled, then
    `steps` decode forwards from the prompt's length, or, after a press that rerotates its
    kept keys to 0..n-1, from n (the pipeline's `cache.get_seq_length()`). Returns (the
    steps + 1 generated tokens, the cache)."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        logits = model(ids, past_key_values=cache).logits
        tokens = [int(logits[0, -1].argmax())]
        rerotated = isinstance(press, kvpress.KeyRerotationPress) or (
            isinstance(press, kvpress.FinchPress) and press.rerotate_keys
        )
        start = cache.get_seq_length() if rerotated else ids.shape[1]
        for step in range(steps):
            position = torch.tensor([[start + step]])
            logits = model(
                torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=position
            ).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens, cache


def decoding_fixture(model, ids, make_press, steps: int) -> dict[str, np.ndarray]:
    press = make_press()
    parts = (
        [press.prefilling_press, press.decoding_press]
        if hasattr(press, "decoding_press")
        else [press]
    )
    tracker = PositionTracker(*parts)
    tokens, cache = decoded(model, ids, press, steps)
    kept = []
    for layer, (cache_layer, attention) in enumerate(
        zip(cache.layers, attention_modules(model), strict=True)
    ):
        if getattr(attention, "masked_key_indices", None) is not None:  # DMS masks
            kept.append(unmasked_positions(attention.masked_key_indices, cache_layer.keys))
            continue
        tracker.extend(layer, cache_layer.keys.shape[1], cache_layer.keys.shape[2])
        kept.append(np.sort(tracker.positions[layer], axis=1))
    return {"kept": padded(kept), "tokens": np.asarray(tokens)}


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return out.stdout.strip()


def main() -> None:
    kvzip_press.AutoTokenizer = ByteTokenizer
    rng = np.random.default_rng(SEED)
    # Distinct tokens: a repeated one has the same key norm, a tie for Knorm.
    ids = torch.tensor(3 + rng.permutation(_COMMON["vocab_size"] - 3)[None, :PROMPT_TOKENS])
    (HERE / "cam").mkdir(exist_ok=True)
    for case, settings in CAM_CASES.items():
        np.savez(HERE / "cam" / f"{case}.npz", **cam_fixture(*settings))
        print("cam", case)
    for model_name in MODELS:
        directory = HERE / model_name
        directory.mkdir(exist_ok=True)
        model = build_model(model_name, directory)
        full = prefill(model, ids)
        eager_full = eager_prefill(model, ids)
        for case, (make_press, _) in CASES.items():
            # A masking press's indices outlive its case; sdpa's prefill clears them, but
            # KVComposePress prefills in eager attention, which kvpress does not patch.
            for attention in attention_modules(model):
                attention.masked_key_indices = None
            press = make_press()
            wraps = hasattr(press, "press")
            if isinstance(press, kvpress.KVzipPress):
                scores = recorded_replay_scores(press)
            elif wraps or not hasattr(press, "score"):
                scores = None
            else:
                scores = recorded_scores(press)
            cache = prefill(model, ids, press)
            reference = eager_full if isinstance(press, kvpress.KVComposePress) else full
            kept = [
                kept_positions(reference.layers[layer].keys, cache.layers[layer].keys)
                if getattr(attention, "masked_key_indices", None) is None
                else unmasked_positions(attention.masked_key_indices, full.layers[layer].keys)
                for layer, attention in enumerate(attention_modules(model))
            ]
            arrays = {"kept": padded(kept)}
            if scores is not None:
                arrays["scores"] = np.stack([scores[layer] for layer in sorted(scores)])
            np.savez(directory / f"{case}.npz", **arrays)
            print(model_name, case, arrays["kept"].shape)
        for case, (make_press, _) in CHANNEL_CASES.items():
            cache = prefill(model, ids, make_press())
            zeroed = np.stack([(layer.keys[0] == 0).all(1).numpy() for layer in cache.layers])
            np.savez(directory / f"{case}.npz", zeroed=zeroed)
            print(model_name, case, zeroed.sum(-1).tolist())
        for case, (make_press, _) in MERGE_CASES.items():
            cache = prefill(model, ids, make_press())
            kept = [
                kept_positions(full.layers[layer].keys, cache.layers[layer].keys)
                for layer in range(len(cache.layers))
            ]
            values = np.stack([layer.values[0].numpy() for layer in cache.layers])
            np.savez(directory / f"{case}.npz", kept=padded(kept), values=values)
            print(model_name, case, values.shape)
        for case, (make_press, _, _, steps) in ROTATION_CASES.items():
            cache = prefill(model, ids, make_press())
            keys = np.stack([layer.keys[0].numpy() for layer in cache.layers])
            tokens, _ = decoded(model, ids, make_press(), steps)
            np.savez(directory / f"{case}.npz", keys=keys, tokens=np.asarray(tokens))
            print(model_name, case, keys.shape, tokens)
        config = model.config
        shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        filters = np.random.default_rng(SEED + 1).standard_normal(shape).astype(np.float32)
        for case, (ratio, _) in FILTER_CASES.items():
            arrays = scored_fixture(model, ids, full, given_filters(ratio, filters))
            np.savez(directory / f"{case}.npz", **arrays, filters=filters)
            print(model_name, case, arrays["kept"].shape)
        stats_rng = np.random.default_rng(SEED + 2)
        heads = (config.num_hidden_layers, config.num_attention_heads, config.head_dim)
        mean = (0.5 * stats_rng.standard_normal(heads)).astype(np.float32)
        factor = 0.3 * stats_rng.standard_normal((*heads, config.head_dim))
        covariance = (factor @ np.swapaxes(factor, -1, -2) / config.head_dim).astype(np.float32)
        for case, (ratio, _) in STATS_CASES.items():
            arrays = scored_fixture(model, ids, full, given_statistics(ratio, mean, covariance))
            statistics = dict(query_mean=mean, query_covariance=covariance)
            np.savez(directory / f"{case}.npz", **arrays, **statistics)
            print(model_name, case, arrays["kept"].shape)
        for case, (ratio, surrogate, _) in SURROGATE_CASES.items():
            rng = np.random.default_rng(SEED + 3)
            weights = surrogate_weights(
                rng,
                surrogate,
                config.num_hidden_layers,
                config.hidden_size,
                config.num_key_value_heads,
            )
            arrays = scored_fixture(model, ids, full, given_surrogate(ratio, surrogate, weights))
            np.savez(directory / f"{case}.npz", **arrays, **weights)
            print(model_name, case, arrays["scores"].shape)
        curve_shape = (99, config.num_hidden_layers, config.num_key_value_heads)
        curve = np.random.default_rng(SEED + 4).uniform(0.0, 1.0, curve_shape).astype(np.float32)
        for case, (make_press, _) in CURVE_CASES.items():
            press = given_curve(make_press, curve)
            scores = recorded_scores(press.press)
            prefill(model, ids, press)
            kept = [  # LUKVPress masks the keys it evicts (every prefill resets the masks)
                unmasked_positions(attention.masked_key_indices, full.layers[layer].keys)
                for layer, attention in enumerate(attention_modules(model))
            ]
            arrays = {
                "kept": padded(kept),
                "scores": np.stack([scores[layer] for layer in sorted(scores)]),
            }
            np.savez(directory / f"{case}.npz", **arrays, prune_shares=np.moveaxis(curve, 0, 1))
            print(model_name, case, arrays["kept"].shape)
        for case, (make_press, _) in SKETCH_CASES.items():
            drawn = []
            original, torch.randn = recording_randn(drawn)
            try:
                arrays = scored_fixture(model, ids, full, make_press())
            finally:
                torch.randn = original
            sketch = np.stack([sample[0].numpy() for sample in drawn])
            np.savez(directory / f"{case}.npz", **arrays, sketch=sketch)
            print(model_name, case, sketch.shape)
        for case, (make_press, _, steps) in DECODING_CASES.items():
            arrays = decoding_fixture(model, ids, make_press, steps)
            np.savez(directory / f"{case}.npz", **arrays)
            print(model_name, case, arrays["kept"].shape, arrays["tokens"].tolist())
    meta = {
        "command": "python tests/kvpress_presses/write_fixtures.py",
        "commit": git_commit(),
        "machine": f"{platform.node()}, {platform.machine()}, python {platform.python_version()}",
        "versions": {
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "prompt": ids[0].tolist(),
        "cases": {case: spec for case, (_, spec) in CASES.items()},
        "channel_cases": {case: spec for case, (_, spec) in CHANNEL_CASES.items()},
        "merge_cases": {case: spec for case, (_, spec) in MERGE_CASES.items()},
        "rotation_cases": {
            case: [spec, kept, steps] for case, (_, spec, kept, steps) in ROTATION_CASES.items()
        },
        "filter_cases": {case: spec for case, (_, spec) in FILTER_CASES.items()},
        "stats_cases": {case: spec for case, (_, spec) in STATS_CASES.items()},
        "sketch_cases": {case: spec for case, (_, spec) in SKETCH_CASES.items()},
        "curve_cases": {case: spec for case, (_, spec) in CURVE_CASES.items()},
        "surrogate_cases": {case: spec for case, (_, _, spec) in SURROGATE_CASES.items()},
        "decoding_cases": {
            case: [spec, steps] for case, (_, spec, steps) in DECODING_CASES.items()
        },
        "cam_cases": sorted(CAM_CASES),
        "argv": sys.argv[1:],
    }
    (HERE / "fixtures.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
