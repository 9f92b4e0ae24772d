"""The kernel benchmark runs end to end (interpreted on CPU) and reports consistent numbers."""

import json

import jax

from jaxkv.benchmarks import kernels


def test_kernel_benchmark_quick(tmp_path):
    out = tmp_path / "kernels.json"
    report = kernels.main(["--quick", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["interpret"] == (jax.default_backend() != "gpu")
    assert report["copy_bandwidth_gbs"] > 0
    sweep = kernels.QUICK
    assert len(report["decode"]) == 2 * len(sweep.decode_tokens) * len(sweep.decode_batches)
    for row in report["decode"]:
        itemsize = 1 if row["pages"] == "int8" else 2
        kv_bytes = 2 * row["batch"] * sweep.kv_heads * row["tokens_per_head"] * sweep.head_dim
        scale_bytes = 2 * row["batch"] * sweep.kv_heads * row["tokens_per_head"] * 4
        expected = kv_bytes * itemsize + (scale_bytes if itemsize == 1 else 0)
        assert row["kv_bytes_read"] == expected
        assert row["achieved_gbs"] > 0 and row["speedup_vs_dense"] > 0
    prefill = report["prefill"]
    assert [row["density"] for row in prefill] == list(sweep.densities)
    visited = [row["visited_blocks"] for row in prefill]
    blocks = sweep.prefill_tokens[0] // sweep.block_q
    assert visited[0] == sweep.kv_heads * blocks * (blocks + 1) // 2  # density 1: all causal
    assert visited == sorted(visited, reverse=True) and visited[-1] >= sweep.kv_heads * blocks
    assert all(row["visited_tflops"] > 0 and row["speedup_vs_dense"] > 0 for row in prefill)
    wgkv = report["wgkv_prefill"]
    assert [row["admission"] for row in wgkv] == list(sweep.wgkv_admission)
    tokens, window = sweep.prefill_tokens[0], sweep.wgkv_window
    band = sum(min(window, i + 1) for i in range(tokens)) / (tokens * (tokens + 1) / 2)
    work = [row["work_fraction"] for row in wgkv]
    assert band < work[0] < work[-1] < 1  # band plus more admitted columns, never all
    assert all(row["kernel_ms"] > 0 and row["speedup_vs_dense_kernel"] > 0 for row in wgkv)
    markdown = out.with_suffix(".md").read_text()
    lines = markdown.splitlines()
    table_rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert len(table_rows) == 3 + len(report["decode"]) + len(prefill) + len(wgkv)  # 3 headers
    out.with_suffix(".md").unlink()
    kernels.main(["--render", str(out)])
    assert out.with_suffix(".md").read_text() == markdown
