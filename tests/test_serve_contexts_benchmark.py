"""`jaxkv bench serve_contexts` at toy sizes: a cached and an uncached run per policy over one
trace of questions on a few documents; the cached runs' answers equal `ask`'s; provenance."""

from __future__ import annotations

import json

import pytest

from jaxkv.benchmarks import serve_contexts

TOY = [
    "--model",
    "tiny-random",
    "--documents",
    "2",
    "--questions",
    "3",
    "--min-document",
    "60",
    "--max-document",
    "90",
    "--min-new",
    "2",
    "--max-new",
    "5",
    "--rate",
    "1000",
    "--max-slots",
    "3",
]


@pytest.fixture(scope="module")
def model_storage(tmp_path_factory):
    """(report, out) of SnapKV and the full cache over the toy trace, the model's dtype."""
    out = tmp_path_factory.mktemp("serve_contexts")
    return serve_contexts.main([*TOY, "--policies", "snapkv:0.5", "full", "--out", str(out)]), out


def test_a_cached_and_an_uncached_run_per_policy_with_ask_s_answers(model_storage):
    report, out = model_storage
    runs = [(row["policy"], row["cached"]) for row in report["rows"]]
    assert runs == [("snapkv:0.5", True), ("snapkv:0.5", False), ("full", True), ("full", False)]
    for row in report["rows"]:
        assert row["requests"] == 6 and row["contexts_evicted"] == 0
        if row["cached"]:
            assert row["equal_to_ask"] == 6
        else:
            assert row["equal_to_ask"] is None and row["hits"] == 0
    saved = json.loads((out / "tiny-random" / "serve_contexts.json").read_text())
    assert saved["provenance"]["command"].startswith("jaxkv bench serve_contexts --model")
    assert "cached / uncached" in (out / "tiny-random" / "serve_contexts.md").read_text()


def test_int8_storage_answers_as_ask_with_it_and_holds_fewer_bytes(tmp_path, model_storage):
    options = ["--storage", "int8", "--full-precision-window", "16", "--policies", "full"]
    int8 = serve_contexts.main([*TOY, *options, "--out", str(tmp_path)])["rows"][0]
    model = next(r for r in model_storage[0]["rows"] if r["policy"] == "full" and r["cached"])
    assert int8["cached"] and int8["equal_to_ask"] == 6
    assert int8["kv_bytes_mean"] < 0.8 * model["kv_bytes_mean"]
    saved = json.loads((tmp_path / "tiny-random" / "serve_contexts.json").read_text())
    assert saved["trace"]["storage"] == "int8"
