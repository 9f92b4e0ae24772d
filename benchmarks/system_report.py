"""The system benchmark's derived columns and report: ratios to the full cache and the roofline
(`derive`), the markdown table and the plot of decode time and peak memory by context."""

from __future__ import annotations

import numpy as np

from jaxkv.benchmarks import harness
from jaxkv.benchmarks.system_model import ITEMSIZE, MIB, weight_bytes


def derive(rows: list[dict], cfg, args, bandwidth_gbs: float) -> None:
    """Adds ratios to the full cache of the same (context, batch) and the roofline columns."""
    read_weights = weight_bytes(cfg, ITEMSIZE[args.dtype])["read_per_step"]
    full = {(r["context"], r["batch"]): r for r in rows if r["policy"] == "full" and ok(r)}
    for row in rows:
        if not ok(row):
            continue
        step_bytes = read_weights + row["kv_bytes_read_per_step"]
        row["weight_bytes_read_per_step"] = read_weights
        bandwidth = row.get("read_bandwidth_gbs", bandwidth_gbs)  # the row's own, on a CPU
        row["roofline_ms_per_step"] = 1e3 * step_bytes / (bandwidth * 1e9)
        if row["decode_ms_per_step"] > 0:
            row["fraction_of_roofline"] = row["roofline_ms_per_step"] / row["decode_ms_per_step"]
        base = full.get((row["context"], row["batch"]))
        if base is None:
            continue
        row["prefill_ratio"] = row["prefill_s"] / base["prefill_s"]
        row["decode_ratio"] = row["decode_ms_per_step"] / base["decode_ms_per_step"]
        row["decode_speedup_vs_full"] = base["decode_ms_per_step"] / row["decode_ms_per_step"]
        row["roofline_speedup_vs_full"] = base["roofline_ms_per_step"] / row["roofline_ms_per_step"]
        for key in ("kv_bytes_after_prefill", "kv_bytes_final", "pool_bytes_allocated"):
            row[key.replace("bytes", "ratio")] = row[key] / base[key]


def ok(row: dict) -> bool:
    return "error" not in row


COLUMNS = (
    ("context", "context", "{}"),
    ("batch", "batch", "{}"),
    ("policy", "policy", "{}"),
    ("first call s", "first_call_s", "{:.2f}"),
    ("prefill s", "prefill_s", "{:.3f}"),
    ("prefill x", "prefill_ratio", "{:.2f}"),
    ("request work of prefill", "request_work_of_prefill", "{:.3f}"),
    ("decode ms/step", "decode_ms_per_step", "{:.2f}"),
    ("+- ms", "decode_spread_ms_per_step", "{:.2f}"),
    ("decode ms by process", "decode_ms_per_step_processes", "list"),
    ("decode x", "decode_ratio", "{:.2f}"),
    ("KV MiB prefill", "kv_bytes_after_prefill", "mib"),
    ("KV MiB end", "kv_bytes_final", "mib"),
    ("KV of full", "kv_ratio_final", "{:.3f}"),
    ("pool MiB", "pool_bytes_allocated", "mib"),
    ("device peak MiB", "device_peak_bytes", "mib"),
    ("host RSS peak MiB", "host_peak_rss_bytes", "mib"),
    ("read GB/s", "read_bandwidth_gbs", "{:.1f}"),
    ("roofline ms", "roofline_ms_per_step", "{:.3f}"),
    ("of roofline", "fraction_of_roofline", "{:.2f}"),
    ("speed-up", "decode_speedup_vs_full", "{:.2f}"),
    ("roofline speed-up", "roofline_speedup_vs_full", "{:.2f}"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if fmt == "list":
        return " / ".join(f"{item:.1f}" for item in value)
    return f"{value / MIB:.1f}" if fmt == "mib" else fmt.format(value)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# System benchmark: {report['model']['name']}",
        "",
        f"{env['device']} ({env['host']}), jax {env['jax']}, {report['date']}; "
        f"read bandwidth {env['bandwidth_gbs']:.1f} GB/s ({env['bandwidth_source']}).",
        "",
        f"`{report['command']}`",
        "",
    ]
    if env["platform"] == "cpu":
        lines += ["**CPU numbers** (no accelerator): times and peaks say little about a GPU.", ""]
    if report.get("note"):
        lines += [report["note"], ""]
    planned = report.get("rows_planned", len(report["rows"]))
    if len(report["rows"]) < planned:
        lines += [
            f"**{len(report['rows'])} of {planned} rows**: the run stopped before the rest.",
            "",
        ]
    lines += [
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    for row in report["rows"]:
        if ok(row):
            cells = [_cell(row, key, fmt) for _, key, fmt in COLUMNS]
        else:
            cells = [str(row["context"]), str(row["batch"]), row["policy"], row["error"]]
            cells += [""] * (len(COLUMNS) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Decode: {report['decode_method']}; +- ms: the two samples' spreads "]
    lines[-1] += "over the decode steps between them."
    lines += ["", report["peak_memory_note"], ""]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    plt = harness.pyplot()

    device_peak = any(r.get("device_peak_bytes") for r in report["rows"])
    peak_key = "device_peak_bytes" if device_peak else "host_peak_rss_bytes"
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["policy"], r["batch"]) for r in report["rows"]})
    for policy, batch in series:
        rows = [r for r in report["rows"] if (r["policy"], r["batch"]) == (policy, batch)]
        rows = sorted((r for r in rows if ok(r)), key=lambda r: r["context"])
        if not rows:
            continue
        contexts = [r["context"] for r in rows]
        label = f"{policy} (batch {batch})"
        ax_time.plot(contexts, [r["decode_ms_per_step"] for r in rows], "o-", label=label)
        peaks = [(r.get(peak_key) or np.nan) / MIB for r in rows]
        ax_mem.plot(contexts, peaks, "o-", label=label)
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    ax_time.set_ylabel("decode ms per step (one token per sequence)")
    ax_mem.set_ylabel(("device peak" if device_peak else "host peak RSS") + " MiB")
    if ax_time.lines:
        ax_time.legend(fontsize=7)
    fig.suptitle(f"{report['model']['name']} on {report['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
