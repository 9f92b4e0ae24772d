"""The quality benchmark's report: one table line per (policy, budget, context) and a panel per
(task, context) of accuracy (bits per byte for bpb) against the KV memory held; `render` rewrites
both beside a saved quality.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxkv.benchmarks import harness
from jaxkv.benchmarks.byte_tasks import TASKS


def markdown_table(rows: list[dict]) -> str:
    """One line per (policy, budget, length): each task's accuracy (bpb for bpb), KV KiB and
    the number of episodes (texts for bpb) behind each cell."""
    tasks_seen = [t for t in TASKS if any(r["task"] == t for r in rows)]
    keys = sorted(
        {(r["policy"], r["budget"], r["length"]) for r in rows},
        key=lambda k: (k[2], k[0], -1 if k[1] is None else k[1]),
    )
    header = "| policy | budget | context | KV KiB/seq | " + " | ".join(tasks_seen) + " | samples |"
    lines = [header, "|" + " --- |" * (5 + len(tasks_seen))]
    for policy, budget, length in keys:
        cells = {
            r["task"]: r
            for r in rows
            if (r["policy"], r["budget"], r["length"]) == (policy, budget, length)
        }
        kib = np.mean([c["kv_bytes_per_sequence"] for c in cells.values()]) / 1024
        values = []
        for task in tasks_seen:
            cell = cells.get(task)
            if cell is None:
                values.append("")
            elif task == "bpb":
                values.append(f"{cell['bits_per_byte']:.3f}")
            else:
                values.append(f"{cell['accuracy']:.2f}")
        budget_text = "auto" if budget is None else f"{budget:g}"
        samples = "/".join(sorted({str(c["samples"]) for c in cells.values()}))
        lines.append(
            f"| {policy} | {budget_text} | {length} | {kib:.0f} | "
            + " | ".join(values)
            + f" | {samples} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy (bits per byte for bpb) against KV KiB held, one panel per (task, length)."""
    plt = harness.pyplot()

    panels = sorted(
        {(r["task"], r["length"]) for r in rows}, key=lambda p: (TASKS.index(p[0]), p[1])
    )
    columns = min(3, len(panels))
    figure, axes = plt.subplots(
        -(-len(panels) // columns),
        columns,
        figsize=(5 * columns, 3.6 * -(-len(panels) // columns)),
        squeeze=False,
    )
    for axis, (task, length) in zip(axes.flat, panels, strict=False):
        metric = "bits_per_byte" if task == "bpb" else "accuracy"
        for name in sorted({r["policy"] for r in rows}):
            points = sorted(
                (r["kv_bytes_per_sequence"] / 1024, r[metric])
                for r in rows
                if r["task"] == task and r["length"] == length and r["policy"] == name
            )
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", label=name)
        axis.set_title(f"{task}, context {length}")
        axis.set_xlabel("KV KiB held per sequence")
        axis.set_ylabel(metric.replace("_", " "))
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(report_path: Path) -> dict:
    """Rewrites the markdown table and plot of a saved report (e.g. after merging runs)."""
    report = json.loads(report_path.read_text())
    table = markdown_table(report["rows"])
    report_path.with_suffix(".md").write_text(table)
    plot(report["rows"], report_path.with_suffix(".png"))
    print(table)
    return report
