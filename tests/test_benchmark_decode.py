"""The decode benchmark harness runs end to end and reports real savings."""

import json

from jaxkv.benchmarks import decode


def test_decode_benchmark_quick(tmp_path):
    out = tmp_path / "decode.json"
    report = decode.main(
        [
            "--prompt-tokens",
            "1024",  # pools above the smallest pool bucket (256 pages)
            "--new-tokens",
            "3",
            "--batch",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["rows"].keys() == report["rows"].keys()
    rows = report["rows"]
    assert rows["full"]["memory_ratio"] == 1.0
    for name in ("streaming_llm", "snapkv", "h2o", "adakv"):
        assert rows[name]["memory_ratio"] < 0.4, name
        assert rows[name]["pool_ratio"] < 0.6, name
    # Quest holds every token (selection reads less) plus its per-page key bounds.
    assert 1.0 < rows["quest"]["memory_ratio"] < 1.1
