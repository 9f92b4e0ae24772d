"""`jaxkv bench serve_contexts` at toy sizes: a cached and an uncached run per policy over one
trace of questions on a few documents; the cached runs' answers equal `ask`'s; provenance."""

from __future__ import annotations

import json

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


def test_a_cached_and_an_uncached_run_per_policy_with_ask_s_answers(tmp_path):
    report = serve_contexts.main([*TOY, "--policies", "snapkv:0.5", "full", "--out", str(tmp_path)])
    runs = [(row["policy"], row["cached"]) for row in report["rows"]]
    assert runs == [("snapkv:0.5", True), ("snapkv:0.5", False), ("full", True), ("full", False)]
    for row in report["rows"]:
        assert row["requests"] == 6 and row["contexts_evicted"] == 0
        if row["cached"]:
            assert row["equal_to_ask"] == 6
        else:
            assert row["equal_to_ask"] is None and row["hits"] == 0
    saved = json.loads((tmp_path / "tiny-random" / "serve_contexts.json").read_text())
    assert saved["provenance"]["command"].startswith("jaxkv bench serve_contexts --model")
    assert "cached / uncached" in (tmp_path / "tiny-random" / "serve_contexts.md").read_text()


def test_int8_storage_answers_as_ask_with_it_and_holds_fewer_bytes(tmp_path):
    runs = {}
    for storage in ("model", "int8"):
        options = ["--storage", storage, "--policies", "full", "--out", str(tmp_path / storage)]
        if storage == "int8":
            options += ["--full-precision-window", "16"]
        runs[storage] = serve_contexts.main([*TOY, *options])["rows"]
    cached = {storage: rows[0] for storage, rows in runs.items()}
    assert cached["int8"]["cached"] and cached["int8"]["equal_to_ask"] == 6
    assert cached["int8"]["kv_bytes_mean"] < 0.8 * cached["model"]["kv_bytes_mean"]
    saved = json.loads((tmp_path / "int8" / "tiny-random" / "serve_contexts.json").read_text())
    assert saved["trace"]["storage"] == "int8"
