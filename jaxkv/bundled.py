"""The files jaxkv ships besides its code: the project's small reference model, and trained
policy parameters (gates, heads) for it and for the pretrained models jaxkv fetches by name
(`assets/` in the repository).

`jaxkv/assets` is a link to the repository's `assets/`, and a wheel carries the same files inside
the package (package data), so these paths hold in a source checkout, an editable install and an
installed wheel alike. Everything that needs a bundled file takes its path from here.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = (Path(__file__).parent / "assets").resolve()
# The reference model in Hugging Face format, with its byte-level tokenizer
# (docs/reference-model.md); `jaxkv generate` uses it without --model.
REFERENCE_MODEL = ASSETS / "reference-model"
# WG-KV write gates for the reference model, one directory per sparsity weight (docs/wgkv.md).
WGKV_GATES = ASSETS / "wgkv-gates"
# Fast KVzip gates for the reference model (docs/fastkvzip.md).
FASTKVZIP_GATES = ASSETS / "fastkvzip-gates"
# DuoAttention retrieval heads (bool [L, K] .npy), one directory per model.
DUO_HEADS = ASSETS / "duo-heads"
# Q-Filters (f32 [L, K, H] filters.npy, `jaxkv train qfilter`), one directory per model.
Q_FILTERS = ASSETS / "q-filters"
# ExpectedAttention's query statistics (statistics.npz, `jaxkv train expected_attention_stats`).
QUERY_STATISTICS = ASSETS / "query-statistics"
# KVzap's surrogates (linear.npz and mlp.npz, `jaxkv train kvzap`), one directory per model.
KVZAP_SURROGATES = ASSETS / "kvzap-surrogates"

# The name jaxkv ships parameters under for its reference model; a fetched model's are under its
# `jaxkv fetch` name.
REFERENCE = "reference"
SMOLLM2 = "smollm2-135m-instruct"

# model name -> policy -> the trained parameters jaxkv ships for it; every directory holds the
# record its training command wrote (run.json / training.json). SmolLM2's are the ones its
# README results use (docs/results.md).
SHIPPED_PARAMS: dict[str, dict[str, Path]] = {
    REFERENCE: {
        "wgkv": WGKV_GATES / "lambda-0.08",
        "fastkvzip": FASTKVZIP_GATES,
        "qfilter": Q_FILTERS / REFERENCE / "source-8x1024",
        "expected_attention_stats": QUERY_STATISTICS / REFERENCE / "source-8x1024",
    },
    SMOLLM2: {
        "wgkv": WGKV_GATES / SMOLLM2 / "docstrings-lambda-0.3-600",
        "fastkvzip": FASTKVZIP_GATES / SMOLLM2 / "docstrings-64-adamw",
        "duo_attention": DUO_HEADS / SMOLLM2 / "copy-0.2" / "heads.npy",
        "qfilter": Q_FILTERS / SMOLLM2 / "source-8x1024",
        "expected_attention_stats": QUERY_STATISTICS / SMOLLM2 / "source-8x1024",
        "kvzap": KVZAP_SURROGATES / SMOLLM2 / "docstrings-96x1024",
    },
}


def shipped_params_path(kind: str, model_name: str | None) -> Path | None:
    """Where jaxkv ships `kind`'s (`policies.LearnedParams.kind`: "wgkv", "qfilter", ...)
    parameters for the model named `model_name` (`REFERENCE` or a fetched model's name), or
    None."""
    return SHIPPED_PARAMS.get(model_name or "", {}).get(kind)


def models_shipping(kind: str) -> list[str]:
    """The model names jaxkv ships `kind`'s parameters for (for error messages)."""
    return [name for name, shipped in SHIPPED_PARAMS.items() if kind in shipped]
