"""The WG-KV Pareto script: points from run.json files, dominance, JSON and PNG written."""

import json

import pytest

from jaxkv.benchmarks import wgkv_pareto


def write_run(directory, sparsity_weight, admitted, distillation):
    directory.mkdir(parents=True)
    summary = {
        "spec": {"sparsity_weight": sparsity_weight},
        "steps_done": 10,
        "heldout": {
            "admitted_fraction": admitted,
            "distillation": distillation,
            "mean_gate": admitted / 2,
            "rows": 4,
        },
    }
    (directory / "run.json").write_text(json.dumps(summary))


def test_points_sorted_and_dominated_point_flagged(tmp_path):
    write_run(tmp_path / "a", 0.01, 0.40, 0.001)
    write_run(tmp_path / "b", 0.04, 0.10, 0.004)
    write_run(tmp_path / "c", 0.02, 0.45, 0.002)  # admits more and loses more than "a"
    points = wgkv_pareto.main([str(tmp_path / name) for name in "abc"] + ["--out", str(tmp_path)])
    assert [p["run"] for p in points] == ["b", "a", "c"]
    assert [p["on_frontier"] for p in points] == [True, True, False]
    report = json.loads((tmp_path / "pareto.json").read_text())
    assert report["points"] == points and report["command"].startswith("jaxkv bench wgkv_pareto")
    assert (tmp_path / "pareto.png").stat().st_size > 1000


def test_unfinished_run_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "run.json").write_text(json.dumps({"spec": {}, "steps_done": 3}))
    with pytest.raises(ValueError, match="held-out"):
        wgkv_pareto.load_points([tmp_path / "x"])
