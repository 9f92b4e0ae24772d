"""`jaxkv.benchmarks.wgkv_admission`: per-head admitted shares, whole-text heads, the marked
example, and one tiny run on the bundled model and gates."""

from __future__ import annotations

import json

import numpy as np

from jaxkv import bundled
from jaxkv.benchmarks import wgkv_admission as admission


def test_whole_text_heads_are_those_outside_the_range_on_every_text():
    shares = np.array(
        [
            [[1.0, 0.0, 0.5, 0.97]],
            [[0.99, 0.01, 0.2, 0.5]],
        ]
    )  # [texts=2, L=1, K=4]
    summary = admission.summarize(shares)
    assert summary["whole_text_heads"] == 2  # heads 0 (all) and 1 (none); head 3 varies
    np.testing.assert_allclose(summary["spread_per_head"], [[0.01, 0.01, 0.3, 0.47]], atol=1e-6)


def test_marked_text_brackets_the_admitted_bytes():
    # Row position p is byte p - 1 of the text (position 0 is BOS).
    assert admission.marked_text(b"ab\ncd", np.array([1, 4]), limit=5) == "[a]b [c]d"
    assert admission.marked_text(b"abcdef", np.array([6]), limit=3) == "abc"


def test_tiny_run_on_the_bundled_gates(tmp_path):
    out = tmp_path / "admission"
    gates = bundled.WGKV_GATES / "lambda-0.08"
    argv = ["--gates", str(gates), "--texts", "2", "--length", "400", "--out", str(out)]
    report = admission.main(argv)
    row = report["gates"]["lambda-0.08"]
    shares = np.asarray(row["mean_share_per_head"])
    assert shares.shape == (6, 2) and np.all((shares >= 0) & (shares <= 1))
    assert json.loads(out.with_suffix(".json").read_text())["texts"] == 2
    assert out.with_suffix(".png").is_file()
    assert "[" in row["example"]["text"] or row["example"]["share_on_text_0"] == 0
