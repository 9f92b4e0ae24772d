"""The real-model quality report (`jaxkv bench real_quality`, and kvpress_reference's table): one
line per (policy, budget, context, setting) with exact match, its 95% Wilson interval and the
leading digits per task, and a panel per (task, setting, context) of exact match against the
share of the full cache's bytes held; and for the policies run at several budgets, one line per
(policy, context, setting) with their exact match at each budget; and the cells two reports
share (jaxkv's against kvpress's) side by side, in episodes; and, where rows record each
episode's outcome, every policy against the full cache on the same episodes: the full cache's
answers it keeps, the answers it gains, and its accuracy over the full cache's with a paired
bootstrap interval."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxkv.benchmarks import harness
from jaxkv.benchmarks.needles import TASKS


def markdown_table(rows: list[dict]) -> str:
    """One line per (policy, budget, length, setting): exact [interval] / leading digits."""
    full = {
        (r["length"], r["task"], r["setting"]): r["kv_bytes_per_sequence"]
        for r in rows
        if r["policy"] == "full"
    }
    lines = [
        "| policy | budget | context | setting | KV of full | needle exact [95% CI] | "
        "needle digits | multikey exact [95% CI] | multikey digits | samples |",
        "|" + " --- |" * 10,
    ]
    keys = sorted(
        {(r["policy"], r["budget"], r["length"], r["setting"]) for r in rows},
        key=lambda k: (k[2], k[3], k[0], -1 if k[1] is None else k[1]),
    )
    for policy, budget, length, setting in keys:
        cells = {
            r["task"]: r
            for r in rows
            if (r["policy"], r["budget"], r["length"], r["setting"])
            == (policy, budget, length, setting)
        }
        shares = [
            c["kv_bytes_per_sequence"] / full[(length, t, setting)]
            for t, c in cells.items()
            if (length, t, setting) in full
        ]
        share = f"{100 * np.mean(shares):.0f}%" if shares else "?"
        values = []
        for task in TASKS:
            cell = cells.get(task)
            if cell is None:
                values += ["", ""]
                continue
            low, high = cell["exact_interval"]
            values += [
                f"{cell['exact']:.2f} [{low:.2f}, {high:.2f}]",
                f"{cell['leading_digits']:.2f}",
            ]
        samples = "/".join(sorted({str(c["samples"]) for c in cells.values()}))
        budget_text = "auto" if budget is None else f"{budget:g}"
        lines.append(
            f"| {policy} | {budget_text} | {length} | {setting} | {share} | "
            + " | ".join(values)
            + f" | {samples} |"
        )
    return "\n".join(lines) + "\n"


def budget_sweeps(rows: list[dict]) -> dict[tuple, dict]:
    """{(policy, length, setting): {(budget, task): row}} for each line run at more than one
    budget."""
    by_line: dict[tuple, dict] = {}
    for r in rows:
        if r["budget"] is not None:
            line = by_line.setdefault((r["policy"], r["length"], r["setting"]), {})
            line[(r["budget"], r["task"])] = r
    return {k: v for k, v in by_line.items() if len({b for b, _ in v}) > 1}


def budget_table(rows: list[dict]) -> str:
    """One line per (policy, length, setting) run at more than one budget: exact match of each
    task and the share of the full cache's bytes at each budget, "-" where not run."""
    full = {
        (r["length"], r["task"], r["setting"]): r["kv_bytes_per_sequence"]
        for r in rows
        if r["policy"] == "full"
    }
    swept = budget_sweeps(rows)
    budgets = sorted({b for line in swept.values() for b, _ in line})
    header = ["policy", "context", "setting"] + [
        f"{task} at {b:g}" for task in TASKS for b in budgets
    ]
    header += [f"KV of full at {b:g}" for b in budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for policy, length, setting in sorted(swept, key=lambda k: (k[1], k[2], k[0])):
        line = swept[(policy, length, setting)]
        exact = [
            f"{line[(b, task)]['exact']:.2f}" if (b, task) in line else "-"
            for task in TASKS
            for b in budgets
        ]
        shares = []
        for b in budgets:
            held = [
                line[(b, t)]["kv_bytes_per_sequence"] / full[(length, t, setting)]
                for t in TASKS
                if (b, t) in line and (length, t, setting) in full
            ]
            shares.append(f"{100 * np.mean(held):.0f}%" if held else "-")
        lines.append(f"| {policy} | {length} | {setting} | " + " | ".join(exact + shares) + " |")
    return "\n".join(lines) + "\n"


def cell_key(row: dict) -> tuple:
    """A row's cell: (policy, budget, length, task, setting)."""
    return row["policy"], row["budget"], row["length"], row["task"], row["setting"]


def agreement_table(rows: list[dict], reference_rows: list[dict]) -> str:
    """One line per cell both reports ran on the same number of episodes: each one's exact
    matches (episodes) and leading digits, and how many episodes apart their exact matches are."""
    reference = {cell_key(r): r for r in reference_rows}
    shared = sorted(
        (c for c in {cell_key(r): r for r in rows}.items() if c[0] in reference),
        key=lambda c: (c[0][2], c[0][3], c[0][4], c[0][0], -1 if c[0][1] is None else c[0][1]),
    )
    lines = [
        "| policy | budget | context | task | setting | exact | reference exact | "
        "episodes apart | digits | reference digits |",
        "|" + " --- |" * 10,
    ]
    for (policy, budget, length, task, setting), row in shared:
        other = reference[(policy, budget, length, task, setting)]
        if other["samples"] != row["samples"]:
            continue
        found, found_there = (round(r["exact"] * r["samples"]) for r in (row, other))
        budget_text = "auto" if budget is None else f"{budget:g}"
        lines.append(
            f"| {policy} | {budget_text} | {length} | {task} | {setting} | "
            f"{found}/{row['samples']} | {found_there}/{other['samples']} | "
            f"{abs(found - found_there)} | {row['leading_digits']:.2f} | "
            f"{other['leading_digits']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def paired_cells(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(row, the full cache's row) of every policy cell that both record each episode's exact
    match on the same episodes (same length, task, setting and samples), in table order."""
    full = {
        (r["length"], r["task"], r["setting"]): r
        for r in rows
        if r["policy"] == "full" and "episode_exact" in r
    }
    baselines = [full.get((r["length"], r["task"], r["setting"])) for r in rows]
    compared = [
        (r, baseline)
        for r, baseline in zip(rows, baselines, strict=True)
        if r["policy"] != "full"
        and "episode_exact" in r
        and baseline is not None
        and baseline["samples"] == r["samples"]
    ]
    return sorted(compared, key=lambda pair: (*cell_key(pair[0])[2:], pair[0]["policy"]))


def paired_table(compared: list[tuple[dict, dict]]) -> str:
    """One line per (row, full cache's row) of `paired_cells`: the episodes both answer, those
    only the policy answers, and exact(policy) / exact(full) with its 95% paired bootstrap
    interval."""
    lines = [
        "| policy | budget | context | task | setting | KV of full | exact | full exact | "
        "full's answers kept | answers full missed | exact / full's [95% CI] |",
        "|" + " --- |" * 11,
    ]
    for row, baseline in compared:
        ours, theirs = (np.asarray(r["episode_exact"], dtype=bool) for r in (row, baseline))
        low, high = harness.paired_ratio_interval(ours, theirs)
        ratio = ours.sum() / theirs.sum() if theirs.any() else float("nan")
        budget_text = "auto" if row["budget"] is None else f"{row['budget']:g}"
        share = row["kv_bytes_per_sequence"] / baseline["kv_bytes_per_sequence"]
        lines.append(
            f"| {row['policy']} | {budget_text} | {row['length']} | {row['task']} | "
            f"{row['setting']} | {100 * share:.0f}% | {ours.sum()}/{len(ours)} | "
            f"{theirs.sum()}/{len(theirs)} | {(ours & theirs).sum()}/{theirs.sum()} | "
            f"{(ours & ~theirs).sum()} | {ratio:.2f} [{low:.2f}, {high:.2f}] |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Exact match against the share of the full cache's bytes: a row of panels per context
    length, a panel per task x setting (empty where that length has no such cell)."""
    plt = harness.pyplot()

    lengths = sorted({r["length"] for r in rows})
    columns = sorted({(r["task"], r["setting"]) for r in rows})
    names = sorted({r["policy"] for r in rows})  # one color and marker per policy, every panel
    colors = plt.get_cmap("tab20").colors
    style = {
        name: dict(color=colors[i % len(colors)], marker="osD^v"[i % 5])
        for i, name in enumerate(names)
    }
    figure, axes = plt.subplots(
        len(lengths),
        len(columns),
        figsize=(5 * len(columns), 3.8 * len(lengths)),
        squeeze=False,
    )
    panels = [(task, setting, length) for length in lengths for task, setting in columns]
    for axis, (task, setting, length) in zip(axes.flat, panels, strict=True):
        cell_rows = [
            r for r in rows if (r["task"], r["setting"], r["length"]) == (task, setting, length)
        ]
        if not cell_rows:
            axis.set_axis_off()
            continue
        full = next((r["kv_bytes_per_sequence"] for r in cell_rows if r["policy"] == "full"), None)
        for name in sorted({r["policy"] for r in cell_rows}):
            points = sorted(
                (r["kv_bytes_per_sequence"] / (full or 1), r["exact"])
                for r in cell_rows
                if r["policy"] == name
            )
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, label=name, **style[name])
        axis.set_title(f"{task}, {setting}, {length} tokens")
        axis.set_xlabel("KV bytes held / full cache's" if full else "KV bytes held")
        axis.set_ylabel("exact match")
        axis.set_ylim(-0.05, 1.05)
        if full:  # the same scale in every panel; Quest holds a little more than the full cache
            axis.set_xlim(0, max(1.1, max(r["kv_bytes_per_sequence"] for r in cell_rows) / full))
    handles = [plt.Line2D([], [], label=name, **style[name]) for name in names]
    axes[0, -1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def write(rows: list[dict], directory: Path) -> str:
    """quality.md, quality-budgets.md (a policy at several budgets), quality-paired.md (cells
    compared with the full cache episode by episode) and quality.png of `rows` in `directory`;
    returns the first table."""
    table = markdown_table(rows)
    (directory / "quality.md").write_text(table)
    if budget_sweeps(rows):
        (directory / "quality-budgets.md").write_text(budget_table(rows))
    compared = paired_cells(rows)
    if compared:
        (directory / "quality-paired.md").write_text(paired_table(compared))
    plot(rows, directory / "quality.png")
    return table


def render(report_path: Path, against: Path | None = None) -> dict:
    """quality.md and quality.png beside a saved report, from its rows; with `against`, another
    report (jaxkv's, for kvpress_reference's), agreement.md: their shared cells side by side."""
    rows = json.loads(report_path.read_text())["rows"]
    print(write(rows, report_path.parent))
    if against is not None:
        ours = json.loads(against.read_text())["rows"]
        table = agreement_table(ours, rows)
        (report_path.parent / "agreement.md").write_text(table)
        print(table)
    return {"rows": rows}
