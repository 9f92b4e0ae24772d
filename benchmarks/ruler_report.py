"""The RULER suite's results (`jaxkv bench ruler`, `ruler_shared`, and the kvpress side): per-sample
records in a JSONL file (the resume point), then kvpress's leaderboard layout: one directory per
(press, compression ratio, setting) holding `predictions.csv` and `metrics.json` ({task:
{"string_match": score}}, and the run's "provenance"), and one table of every cell's task scores and
their average (`leaderboard.csv`, `.json`, `.md`), a plot of the average against the compression
ratio per policy, and the table of jaxkv minus kvpress for the presses both ran.

Scores are RULER's: a task's score is the mean over its samples of `string_match_all`, x100; the
average is the mean of the task scores (kvpress's `average_score`). A cell's kept share is the
mean over its samples of the KV bytes held after compression over the full cache's on the same
sample (agnostic: the context's).
"""

from __future__ import annotations

import csv
import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np

from jaxkv.benchmarks import harness

RECORD_KEY = ("task", "index", "policy", "ratio", "setting")
LEGEND_COLUMNS = 4  # the plot's legend, below its panels
# kvpress presses changed to test one difference from jaxkv's policy of the same name
# (`benchmarks/kvpress_reference.py` says what each changes), each set against the jaxkv
# policy entry that scores as it does: KVzip as the paper's code scores (`KVzip`'s docstring).
KVPRESS_VARIANTS = {"kvzip_scored_prefix": "kvzip:chunk=2048:sinks=4:prompt_turn=context"}


def record_key(record: dict) -> tuple:
    """The (task, sample, policy, ratio, setting) a record answers: what a rerun skips."""
    return tuple(record[k] for k in RECORD_KEY)


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL file in order, a cut line (a run killed while writing it) dropped;
    [] when there is no file."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def load_records(path: Path) -> list[dict]:
    """The records of a JSONL file, the last one of each key kept (a cut line is dropped)."""
    return list({record_key(record): record for record in read_jsonl(path)}.values())


def append_record(path: Path, record: dict) -> None:
    """One record, on a line of its own (after a cut last line, a new one), flushed: a run cut
    after it resumes past it."""
    cut = path.exists() and path.stat().st_size > 0 and not _ends_with_newline(path)
    with path.open("a") as file:
        file.write(("\n" if cut else "") + json.dumps(record) + "\n")
        file.flush()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as file:
        file.seek(-1, 2)
        return file.read(1) == b"\n"


def cell_name(benchmark: str, length: int, model: str, policy: str, ratio: float, setting: str):
    """kvpress's run directory name: dataset__data_dir__model__press__ratio[__query_aware]."""
    name = f"{benchmark}__{length}__{model}__{policy}__{ratio:.2f}"
    return name + ("__query_aware" if setting == "aware" else "")


def _full_bytes(records: list[dict]) -> dict[tuple, float]:
    return {
        (r["task"], r["index"]): r["kv_bytes"]
        for r in records
        if r["policy"] == "full" and r.get("kv_bytes")
    }


def leaderboard(records: list[dict], tasks: list[str]) -> list[dict]:
    """One row per (policy, ratio, setting): each task's score (x100) and samples, the average
    over the tasks it has, and the mean kept share of the full cache's bytes."""
    full = _full_bytes(records)
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["policy"], r["ratio"], r["setting"])].append(r)
    rows = []
    for (policy, ratio, setting), found in sorted(cells.items(), key=lambda c: _order(c[0])):
        by_task = defaultdict(list)
        for r in found:
            by_task[r["task"]].append(r["score"])
        scores = {t: 100 * float(np.mean(by_task[t])) for t in tasks if t in by_task}
        shares = [
            r["kv_bytes"] / (full[(r["task"], r["index"])] * _prompt_share(r))
            for r in found
            if (r["task"], r["index"]) in full and r.get("kv_bytes")
        ]
        rows.append(
            {
                "policy": policy,
                "compression_ratio": ratio,
                "setting": setting,
                "tasks": scores,
                "samples": {t: len(by_task[t]) for t in tasks if t in by_task},
                "average": float(np.mean(list(scores.values()))) if scores else float("nan"),
                "kept_share": float(np.mean(shares)) if shares else None,
                "tau": found[0].get("tau"),
            }
        )
    return rows


def _prompt_share(record: dict) -> float:
    """The tokens a record's cache was compressed from over the context's: an aware cell
    compresses the question too (`compressed_tokens`), so its kept share is of a full cache of
    the context and the question."""
    if record["setting"] != "aware" or not record.get("context_tokens"):
        return 1.0
    return record["compressed_tokens"] / record["context_tokens"]


def _order(cell: tuple) -> tuple:
    policy, ratio, setting = cell
    return (policy != "full", setting, policy, ratio)


def markdown(rows: list[dict], tasks: list[str]) -> str:
    """The leaderboard as a markdown table (scores x100; samples per task in the last column)."""
    header = ["policy", "ratio", "setting", "kept", *tasks, "average", "samples"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        kept = "" if row["kept_share"] is None else f"{100 * row['kept_share']:.0f}%"
        label = row["policy"] + (f" (tau {row['tau']:.3g})" if row.get("tau") else "")
        scores = [f"{row['tasks'][t]:.1f}" if t in row["tasks"] else "" for t in tasks]
        counts = "/".join(sorted({str(n) for n in row["samples"].values()}))
        lines.append(
            f"| {label} | {row['compression_ratio']:.3g} | {row['setting']} | {kept} | "
            + " | ".join(scores)
            + f" | {row['average']:.1f} | {counts} |"
        )
    return "\n".join(lines) + "\n"


def write_cells(records: list[dict], out: Path, benchmark: str, run: dict) -> None:
    """kvpress's per-run layout: OUT/cells/NAME/predictions.csv and metrics.json per cell (its
    task scores, and the run's provenance beside them); a cell no record holds any more (its
    records dropped to run again) is removed."""
    length, model = run["length"], run["model_name"]
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["policy"], r["ratio"], r["setting"])].append(r)
    names = {key: cell_name(benchmark, length, model, *key) for key in cells}
    if (out / "cells").is_dir():
        for stale in set(p.name for p in (out / "cells").iterdir()) - set(names.values()):
            shutil.rmtree(out / "cells" / stale)
    for (policy, ratio, setting), found in cells.items():
        directory = out / "cells" / names[(policy, ratio, setting)]
        directory.mkdir(parents=True, exist_ok=True)
        found = sorted(found, key=lambda r: (r["task"], r["index"]))
        with (directory / "predictions.csv").open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["task", "index", "predicted_answer", "answer", "score", "kv_bytes"])
            for r in found:
                writer.writerow(
                    [r["task"], r["index"], r["prediction"], json.dumps(r["outputs"]), r["score"]]
                    + [r.get("kv_bytes")]
                )
        by_task = defaultdict(list)
        for r in found:
            by_task[r["task"]].append(r["score"])
        metrics = {
            t: {"string_match": round(100 * float(np.mean(s)), 2)} for t, s in by_task.items()
        }
        metrics["provenance"] = run["provenance"]
        (directory / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def write_leaderboard(rows: list[dict], tasks: list[str], out: Path, run: dict) -> str:
    """leaderboard.csv / .json / .md in OUT (the JSON opens with the run's provenance)."""
    with (out / "leaderboard.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["policy", "compression_ratio", "setting", "kept_share", *tasks, "average"])
        for row in rows:
            writer.writerow(
                [row["policy"], row["compression_ratio"], row["setting"], row["kept_share"]]
                + [row["tasks"].get(t) for t in tasks]
                + [row["average"]]
            )
    table = markdown(rows, tasks)
    text = f"# {run['title']}\n\n{harness.provenance_line(run['provenance'])}\n\n{table}"
    harness.save(out, "leaderboard", {**run, "rows": rows}, text)
    return text


def expected_samples(rows: list[dict]) -> dict[str, int]:
    """Per task, the most samples any cell has: a cell with fewer is still running."""
    expected: dict[str, int] = {}
    for row in rows:
        for task, count in row["samples"].items():
            expected[task] = max(expected.get(task, 0), count)
    return expected


def policy_points(
    rows: list[dict], setting: str, expected: dict[str, int]
) -> dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]]:
    """Per policy of `setting` (the full cache aside), its (ratio, average) points sorted by
    ratio, split into finished cells (the line) and cells still running (hollow markers, not
    joined: a few samples' average is no point on the curve)."""
    points = defaultdict(lambda: ([], []))
    for r in sorted(rows, key=lambda r: r["compression_ratio"]):
        if r["policy"] != "full" and r["setting"] == setting:
            finished, running = points[r["policy"]]
            cell = (r["compression_ratio"], r["average"])
            (finished if r["samples"] == expected else running).append(cell)
    return dict(points)


def plot(rows: list[dict], out: Path, title: str) -> Path:
    """Average score against compression ratio, one line per policy through its finished cells
    (the same colour and marker in every panel), a panel per setting; a hollow, unjoined marker
    is a cell still running (fewer samples than `expected_samples`)."""
    plt = harness.pyplot()
    settings = sorted({r["setting"] for r in rows if r["policy"] != "full"}) or ["agnostic"]
    names = sorted({r["policy"] for r in rows if r["policy"] != "full"})
    legend_rows = -(-(len(names) + 1) // LEGEND_COLUMNS)  # the policies and the full cache
    legend_height = 0.25 * legend_rows  # inches, below the panels
    fig, axes = plt.subplots(
        1,
        len(settings),
        figsize=(6 * len(settings), 4.5 + legend_height),
        squeeze=False,
        sharex=True,
    )
    full = [r["average"] for r in rows if r["policy"] == "full"]
    expected = expected_samples(rows)
    colours, markers = plt.get_cmap("tab20").colors, "osD^v<>phX*P"
    styles = {n: (colours[i % 20], markers[i % len(markers)]) for i, n in enumerate(names)}
    for axis, setting in zip(axes[0], settings, strict=True):
        for policy, (finished, running) in sorted(policy_points(rows, setting, expected).items()):
            colour, marker = styles[policy]
            if finished:
                xs, ys = zip(*finished, strict=True)
                axis.plot(xs, ys, color=colour, marker=marker, label=policy)
            if running:
                xs, ys = zip(*running, strict=True)
                label = None if finished else policy
                axis.scatter(
                    xs,
                    ys,
                    marker=marker,
                    facecolors="white",
                    edgecolors=colour,
                    zorder=3,
                    label=label,
                )
        if full:
            axis.axhline(full[0], color="black", linestyle="--", label="full")
        axis.set(xlabel="compression ratio (share evicted)", ylabel="RULER average", title=setting)
    legend = {}
    for axis in axes[0]:
        legend.update(zip(*reversed(axis.get_legend_handles_labels()), strict=True))
    labels = sorted(legend, key=lambda label: (label == "full", label))
    handles = [legend[label] for label in labels]
    fig.legend(handles, labels, loc="lower center", ncol=LEGEND_COLUMNS, fontsize=8)
    fig.suptitle(
        f"{title}\n(hollow, off the line: a cell still running, fewer samples than the others)"
    )
    fig.tight_layout(rect=(0, (legend_height + 0.1) / fig.get_figheight(), 1, 1))
    path = out / "ruler.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def versus_kvpress(ours: list[dict], theirs: list[dict], tasks: list[str]) -> str:
    """jaxkv minus kvpress per task and on average, for every (press, ratio, setting) both ran,
    over the samples both answered, with how many of its predictions are equal; and the full
    cache's count again below the table. A kvpress variant (`KVPRESS_VARIANTS`) is set against
    its jaxkv policy, its row named "policy vs variant"."""
    mine = {record_key(r): r for r in ours}
    shared = []
    for r in theirs:
        key = record_key({**r, "policy": KVPRESS_VARIANTS.get(r["policy"], r["policy"])})
        if key in mine:
            shared.append((mine[key], r))
    cells = defaultdict(list)
    for a, b in shared:
        cells[_pair_cell(a, b)].append((a, b))
    lines = [
        "| policy | ratio | setting | "
        + " | ".join(tasks)
        + " | average | samples | same predictions |",
        "|" + " --- |" * (len(tasks) + 6),
    ]
    for (policy, ratio, setting), pairs in sorted(cells.items(), key=lambda c: _order(c[0])):
        diffs = {}
        for task in tasks:
            found = [(a["score"], b["score"]) for a, b in pairs if a["task"] == task]
            if found:
                diffs[task] = 100 * (
                    np.mean([x for x, _ in found]) - np.mean([y for _, y in found])
                )
        cells_text = [f"{diffs[t]:+.1f}" if t in diffs else "" for t in tasks]
        average = np.mean(list(diffs.values())) if diffs else float("nan")
        lines.append(
            f"| {policy} | {ratio:.3g} | {setting} | "
            + " | ".join(cells_text)
            + f" | {average:+.1f} | {len(pairs)} | {_same_predictions(pairs)} |"
        )
    full = [(a, b) for a, b in shared if a["policy"] == "full"]
    same = _same_predictions(full)
    text = "\n".join(lines) + f"\n\nFull cache: {same}/{len(full)} predictions identical.\n"
    return text + _differing(shared)


def _pair_cell(ours: dict, theirs: dict) -> tuple:
    """The (policy, ratio, setting) of a (jaxkv, kvpress) record pair, the policy named
    "policy vs variant" when kvpress ran a variant of it."""
    name = ours["policy"]
    if theirs["policy"] != name:
        name = f"{name} vs {theirs['policy']}"
    return name, ours["ratio"], ours["setting"]


def _differing(shared) -> str:
    """The (jaxkv, kvpress) record pairs whose predictions differ, a row each (predictions cut
    at 60 characters, as JSON strings, pipes escaped), or nothing when every pair agrees."""
    pairs = [(a, b) for a, b in shared if a["prediction"].strip() != b["prediction"].strip()]
    if not pairs:
        return ""
    lines = [
        "",
        "Predictions that differ:",
        "",
        "| policy | ratio | setting | task | sample | jaxkv | kvpress | scores |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a, b in sorted(pairs, key=lambda p: (_order(_pair_cell(*p)), record_key(p[0]))):
        jaxkv, kvpress = (
            json.dumps(r["prediction"].strip()[:60]).replace("|", "\\|") for r in (a, b)
        )
        lines.append(
            f"| {_pair_cell(a, b)[0]} | {a['ratio']:.3g} | {a['setting']} | {a['task']} "
            f"| {a['index']} | {jaxkv} | {kvpress} | {a['score']:.2f} / {b['score']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _same_predictions(pairs) -> int:
    """How many (jaxkv, kvpress) record pairs predict the same text."""
    return sum(a["prediction"].strip() == b["prediction"].strip() for a, b in pairs)
