"""Pareto curve of trained WG-KV gates: held-out distillation loss against the admitted fraction.

Reads every `run.json` written by `jaxkv train wgkv` under the given run directories (one per
lambda), prints a table and writes pareto.json and pareto.png. The admitted fraction is the share
of (layer, KV head, token) whose gate exceeds tau = 0.1, on held-out rows; the distillation loss
is the MSE of the final-normed hidden states against the full-attention backbone on those rows.

    python -m jaxkv.benchmarks.wgkv_pareto assets/wgkv-gates/lambda-* --out assets/wgkv-gates
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxkv.benchmarks import harness


def load_points(run_dirs: list[Path]) -> list[dict]:
    """One point per run directory, sorted by admitted fraction."""
    points = []
    for run_dir in run_dirs:
        summary = json.loads((run_dir / "run.json").read_text())
        if "heldout" not in summary:
            raise ValueError(f"{run_dir}/run.json has no held-out evaluation (unfinished run?)")
        heldout = summary["heldout"]
        points.append(
            {
                "run": run_dir.name,
                "sparsity_weight": summary["spec"]["sparsity_weight"],
                "admitted_fraction": heldout["admitted_fraction"],
                "distillation": heldout["distillation"],
                "mean_gate": heldout["mean_gate"],
                "steps": summary["steps_done"],
                "heldout_rows": heldout["rows"],
            }
        )
    return sorted(points, key=lambda p: p["admitted_fraction"])


def dominates(a: dict, b: dict) -> bool:
    """a admits no more and loses no more than b, and is strictly better in one of the two."""
    pairs = [(a[key], b[key]) for key in ("admitted_fraction", "distillation")]
    return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)


def on_frontier(points: list[dict]) -> list[bool]:
    """True for points that no other point dominates."""
    return [not any(dominates(other, point) for other in points) for point in points]


def plot(points: list[dict], path: Path) -> None:
    plt = harness.pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.6))
    xs = [100 * p["admitted_fraction"] for p in points]
    ys = [p["distillation"] for p in points]
    ax.plot(xs, ys, "o-")
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(
            f"λ={p['sparsity_weight']:g}", (x, y), textcoords="offset points", xytext=(4, 4)
        )
    ax.set_xlabel("admitted tokens (%, g > 0.1, held-out)")
    ax.set_ylabel("distillation loss (hidden-state MSE)")
    ax.set_title("WG-KV gates on the reference model")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="jaxkv bench wgkv_pareto", description=__doc__)
    parser.add_argument("runs", type=Path, nargs="+", help="directories holding run.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    points = load_points(args.runs)
    for point, frontier in zip(points, on_frontier(points), strict=True):
        point["on_frontier"] = frontier
    print(f"{'lambda':>8} {'admitted %':>10} {'distillation':>13} {'mean g':>7} {'steps':>6}")
    for p in points:
        print(
            f"{p['sparsity_weight']:>8g} {100 * p['admitted_fraction']:>10.1f} "
            f"{p['distillation']:>13.3e} {p['mean_gate']:>7.3f} {p['steps']:>6}"
        )
    report = {**harness.provenance("jaxkv bench wgkv_pareto", argv), "points": points}
    harness.save(args.out, "pareto", report)
    plot(points, args.out / "pareto.png")
    return points


if __name__ == "__main__":
    main()
