"""The end-to-end system benchmark runs, reports against the full cache, and refuses sizes that
cannot fit with the largest size that does."""

import gc
import json
import weakref

import pytest

from jaxkv.benchmarks import system

TINY = ["--cpu", "--model", "tiny-random", "--batches", "1", "--decode-tokens", "2"]
TINY += ["--decode-start", "2"]
TINY += ["--repeats", "1", "--bandwidth-gbs", "10"]


def _rows(report):
    return {row["policy"]: row for row in report["rows"]}


def test_in_process_rows_fields_and_ratios(tmp_path):
    out = tmp_path / "tiny"
    # Long enough for the full cache's pool to outgrow the smallest pool bucket (256 pages).
    argv = [*TINY, "--contexts", "2048", "--in-process", "--out", str(out)]
    argv += ["--policies", "full", "streaming_llm:0.25", "snapkv:16"]
    report = system.main(argv)
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == report["rows"]
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0
    assert report["cpu_numbers"] and report["environment"]["jax"]
    assert report["decode_method"] and report["command"].startswith("jaxkv bench system")
    assert report["settings"]["decode_start"] == 2
    assert len(report["rows"][0]["generate_1_plus_s_plus_d_times_s"]) == 1
    rows = _rows(report)
    full, streaming = rows["full"], rows["streaming_llm:0.25"]
    for key in ("prefill_ratio", "decode_ratio", "kv_ratio_final", "roofline_speedup_vs_full"):
        assert full[key] == 1.0, key
    for key in (
        "first_call_s",
        "prefill_s",
        "decode_ms_per_step",
        "request_work_s",
        "request_work_of_prefill",
        "pool_bytes_allocated",
        "host_peak_rss_bytes",
        "roofline_ms_per_step",
    ):
        assert streaming[key] is not None, key
    assert streaming["device_peak_bytes"] is None  # CPU: no device memory stats
    assert streaming["kv_bytes_final"] < full["kv_bytes_final"]
    assert streaming["kv_bytes_after_prefill"] < full["kv_bytes_after_prefill"]
    assert streaming["pool_bytes_allocated"] < full["pool_bytes_allocated"]
    # A policy that cannot work at this context reports jaxkv's error; the run goes on.
    assert "each head protects" in rows["snapkv:16"]["error"]
    assert "snapkv:16" in out.with_suffix(".md").read_text()


def test_no_earlier_output_is_alive_while_a_call_is_timed(tmp_path, monkeypatch):
    """An output holds its KV state: the device peak of a row is one request's only if no
    earlier output outlives its reading (on an H100 two held outputs added two full pools)."""
    real_generate, outputs, alive_at_calls = system.jaxkv.generate, [], []

    def counting_generate(*args, **kwargs):
        gc.collect()
        alive_at_calls.append(sum(ref() is not None for ref in outputs))
        out = real_generate(*args, **kwargs)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(system.jaxkv, "generate", counting_generate)
    argv = [*TINY, "--contexts", "64", "--in-process", "--out", str(tmp_path / "t")]
    report = system.main([*argv, "--policies", "full"])
    assert report["rows"][0]["kv_bytes_final"] > report["rows"][0]["kv_bytes_after_prefill"] > 0
    assert len(alive_at_calls) == 3 + 3 and set(alive_at_calls) == {0}  # 3 compiling, 3 timed


def test_context_that_cannot_fit_names_the_largest_that_does(tmp_path):
    argv = [*TINY, "--contexts", str(10**9), "--memory-limit-gib", "1", "--in-process"]
    report = system.main([*argv, "--policies", "full", "--out", str(tmp_path / "big")])
    (row,) = report["rows"]
    assert row["error"].startswith("does not fit")
    assert "largest context that fits at batch 1: ~" in row["error"]
    largest = int(row["error"].split("batch 1: ~")[1].split()[0])
    assert 0 < largest < 10**9


def test_subprocess_row(tmp_path):
    out = tmp_path / "sub"
    argv = [*TINY, "--contexts", "64", "--policies", "full", "--out", str(out)]
    (row,) = system.main(argv)["rows"]
    assert "error" not in row, row.get("error")
    assert row["kv_ratio_final"] == 1.0 and row["host_peak_rss_bytes"] > 0


def test_cpu_rows_measure_the_read_rate_over_their_own_step_bytes(tmp_path, monkeypatch):
    """Without --bandwidth-gbs a CPU row's roofline is its step's bytes over the read rate
    measured over that many bytes (a smaller step may sit in the last-level cache)."""
    probed = []

    def rate_by_size(num_bytes, repeats):
        probed.append(num_bytes)
        return 1e9 * (20.0 if num_bytes > 1 << 20 else 40.0)

    monkeypatch.setattr(system.harness, "read_bandwidth", rate_by_size)
    argv = [arg for arg in TINY if arg not in ("--bandwidth-gbs", "10")]
    argv += ["--contexts", "256", "--in-process", "--out", str(tmp_path / "tiny")]
    report = system.main([*argv, "--policies", "full", "streaming_llm:0.25"])
    assert report["environment"]["bandwidth_source"].startswith("measured: jitted row sums")
    assert report["environment"]["cpu_caches"] == system.cpu_caches()
    for row in report["rows"]:
        step = row["weight_bytes_read_per_step"] + row["kv_bytes_read_per_step"]
        assert row["read_bandwidth_bytes"] == int(step) and row["read_bandwidth_bytes"] in probed
        assert row["roofline_ms_per_step"] == 1e3 * step / (row["read_bandwidth_gbs"] * 1e9)


def test_cpu_caches_read_linux_sysfs(tmp_path):
    for name, (level, kind, size) in {
        "index0": (1, "Data", "48K"),
        "index3": (3, "Unified", "300M"),
    }.items():
        (tmp_path / name).mkdir()
        for field, value in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / name / field).write_text(f"{value}\n")
    assert system.cpu_caches(tmp_path) == {"L1 Data": "48K", "L3 Unified": "300M"}
    assert system.cpu_caches(tmp_path / "absent") == {}


def test_processes_keep_the_fastest_decode_and_the_strictest_roofline(tmp_path, monkeypatch):
    """--processes N runs every row N times round-robin and keeps the fastest decode, its
    roofline at the highest read rate probed."""
    calls = []

    def fake_row(argv, row, limit, cfg, args):
        calls.append(row["policy"])
        decode = {"full": [40.0, 30.0, 35.0], "streaming_llm:0.25": [9.0, 12.0, 10.0]}
        rate = [30.0, 20.0, 40.0][calls.count(row["policy"]) - 1]
        return {
            "decode_ms_per_step": decode[row["policy"]][calls.count(row["policy"]) - 1],
            "read_bandwidth_gbs": rate,
            "prefill_s": 1.0,
            "kv_bytes_read_per_step": 1e8,
            **{key: 1 for key in ("kv_bytes_after_prefill", "kv_bytes_final")},
            "pool_bytes_allocated": 1,
        }

    monkeypatch.setattr(system, "row_in_subprocess", fake_row)
    monkeypatch.setattr(system, "_environment", lambda args, argv: _FAKE_ENV)
    argv = [*TINY, "--contexts", "64", "--processes", "3", "--out", str(tmp_path / "p")]
    report = system.main([*argv, "--policies", "full", "streaming_llm:0.25"])
    assert calls == ["full", "streaming_llm:0.25"] * 3
    rows = _rows(report)
    assert rows["full"]["decode_ms_per_step"] == 30.0
    assert rows["full"]["decode_ms_per_step_processes"] == [40.0, 30.0, 35.0]
    assert rows["streaming_llm:0.25"]["decode_ms_per_step"] == 9.0
    for row in rows.values():
        assert row["read_bandwidth_gbs"] == 40.0
        step = row["weight_bytes_read_per_step"] + 1e8
        assert row["roofline_ms_per_step"] == 1e3 * step / 40e9
    assert rows["streaming_llm:0.25"]["decode_speedup_vs_full"] == 30.0 / 9.0
    assert "3 processes" in report["decode_method"]
    assert "40.0 / 30.0 / 35.0" in (tmp_path / "p.md").read_text()


def test_a_run_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """Each finished row is saved at once: a run killed mid-grid (a device session's time box)
    leaves the rows before it, and the markdown says how many were planned."""

    def fake_row(argv, row, limit, cfg, args):
        if row["policy"] != "full":
            raise KeyboardInterrupt  # what a time box's signal does mid-row
        return {
            "decode_ms_per_step": 30.0,
            "prefill_s": 1.0,
            "kv_bytes_read_per_step": 1e8,
            **{key: 1 for key in ("kv_bytes_after_prefill", "kv_bytes_final")},
            "pool_bytes_allocated": 1,
        }

    monkeypatch.setattr(system, "row_in_subprocess", fake_row)
    monkeypatch.setattr(system, "_environment", lambda args, argv: _FAKE_ENV)
    argv = [*TINY, "--contexts", "64", "--out", str(tmp_path / "cut")]
    with pytest.raises(KeyboardInterrupt):
        system.main([*argv, "--policies", "full", "streaming_llm:0.25"])
    saved = json.loads((tmp_path / "cut.json").read_text())
    assert [row["policy"] for row in saved["rows"]] == ["full"]
    assert saved["rows_planned"] == 2 and saved["rows"][0]["decode_ms_per_step"] == 30.0
    assert "**1 of 2 rows**" in (tmp_path / "cut.md").read_text()


def test_an_error_in_any_process_is_the_rows():
    good = {"decode_ms_per_step": 1.0}
    assert system.fastest_process([good, {"error": "boom"}]) == {"error": "boom"}
    with pytest.raises(SystemExit, match="--processes"):
        system.parse_args([*TINY, "--processes", "2", "--in-process"])


_FAKE_ENV = {
    "memory_limit_bytes": 1 << 40,
    "bandwidth_gbs": 10.0,
    "platform": "cpu",
    "device": "cpu",
    "host": "test",
    "jax": "test",
    "bandwidth_source": "fake",
}
