"""Which tokens WG-KV's write gates admit: per (layer, KV head), across held-out texts.

For each gate set, each held-out text (standard-library corpus, heldout split) is prefilled with
`policies.WGKV` (its default tau and band) and the global cache's positions are read back: a
head's admitted share is the tokens it holds among those that left the band (positions below
T - window). Reported per head: the mean share over texts and its spread (max - min), and
overall the share of heads that decide for whole texts (every text's share above 0.95 or below
0.02: admission that does not depend on the input). One text is printed with the bytes a chosen
head admits in [brackets]. Writes `<out>.json`, `<out>.md` and `<out>.png` (histograms of the
per-(head, text) shares).

    python -m jaxkv.benchmarks.wgkv_admission --gates assets/wgkv-gates/lambda-0.005 \\
        assets/wgkv-gates/lambda-0.02 assets/wgkv-gates/lambda-0.08 \\
        --out results/wgkv-admission/admission
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import jaxkv
from jaxkv import bundled, policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.byte_tasks import BOS
from jaxkv.gates.wgkv import load_write_gates
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib

WHOLE_TEXT = (0.02, 0.95)  # a share outside this range on every text: a whole-text decision


def admitted_shares(model, gates, texts: list[bytes], policy) -> tuple[np.ndarray, list]:
    """f32 [texts, L, K] admitted share of the tokens that left the band, and each text's
    admitted positions [L, K] (sorted int arrays)."""
    shares, positions = [], []
    for text in texts:
        row = [BOS, *text]
        kv = jaxkv.compress_prompt(model, [row], policy, policy_params=gates)
        held = np.asarray(kv.positions())[:, 0]  # [L, K, S]
        outside = len(row) - policy.window
        admitted = [[np.sort(h[(h >= 0) & (h < outside)]) for h in layer] for layer in held]
        counts = np.array([[len(a) for a in layer] for layer in admitted])
        shares.append(counts / max(outside, 1))
        positions.append(admitted)
    return np.asarray(shares, np.float32), positions


def summarize(shares: np.ndarray) -> dict:
    low, high = WHOLE_TEXT
    whole = np.all(shares > high, axis=0) | np.all(shares < low, axis=0)  # [L, K]
    return {
        "mean_share_per_head": shares.mean(axis=0).round(4).tolist(),
        "spread_per_head": (shares.max(axis=0) - shares.min(axis=0)).round(4).tolist(),
        "whole_text_heads": int(whole.sum()),
        "heads": int(whole.size),
        "mean_share": float(shares.mean()),
    }


def marked_text(text: bytes, admitted: np.ndarray, limit: int) -> str:
    """The first `limit` bytes of `text` with the admitted ones in [brackets] (position p of
    the row is byte p - 1 of the text: the row starts with BOS)."""
    chosen = set((admitted - 1).tolist())
    out = []
    for i, byte in enumerate(text[:limit]):
        char = chr(byte) if 32 <= byte < 127 else " "
        out.append(f"[{char}]" if i in chosen else char)
    return "".join(out)


def example(shares: np.ndarray, positions, texts, limit: int) -> dict:
    """The head whose mean share is nearest 0.3 (neither all nor nothing), on the first text."""
    mean = shares.mean(axis=0)
    layer, head = np.unravel_index(np.argmin(np.abs(mean - 0.3)), mean.shape)
    return {
        "layer": int(layer),
        "kv_head": int(head),
        "share_on_text_0": float(shares[0, layer, head]),
        "text": marked_text(texts[0], positions[0][layer][head], limit),
    }


def markdown(report: dict) -> str:
    lines = [
        f"# WG-KV admission per head ({report['texts']} held-out texts of {report['length']} "
        f"bytes; tau {report['tau']}, band {report['window']})",
        "",
        harness.provenance_line(report),
        "",
        "| gates | mean admitted share | heads deciding for whole texts | per-head share "
        "spread over texts (median) |",
        "|---|---|---|---|",
    ]
    for name, row in report["gates"].items():
        spread = np.median(np.asarray(row["spread_per_head"]))
        lines.append(
            f"| {name} | {row['mean_share']:.3f} | {row['whole_text_heads']} of {row['heads']} "
            f"| {spread:.3f} |"
        )
    for name, row in report["gates"].items():
        ex = row["example"]
        lines += [
            "",
            f"## {name}: layer {ex['layer']}, KV head {ex['kv_head']} on text 0 "
            f"(share {ex['share_on_text_0']:.2f}; admitted bytes in [brackets])",
            "",
            "```",
            ex["text"],
            "```",
            "",
            "Mean share per (layer, head): " + json.dumps(row["mean_share_per_head"]),
        ]
    return "\n".join(lines) + "\n"


def plot(report: dict, shares: dict[str, np.ndarray], path: Path) -> None:
    plt = harness.pyplot()

    fig, axes = plt.subplots(1, len(shares), figsize=(5 * len(shares), 3.5), squeeze=False)
    for ax, (name, values) in zip(axes[0], shares.items(), strict=True):
        ax.hist(values.reshape(-1), bins=np.linspace(0, 1, 21))
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("admitted share of a (layer, head) on one text")
    axes[0][0].set_ylabel("(layer, head, text) count")
    fig.suptitle(f"WG-KV admission, {report['texts']} held-out texts of {report['length']} bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench wgkv_admission", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", type=Path, default=bundled.REFERENCE_MODEL)
    parser.add_argument("--gates", type=Path, nargs="+", required=True)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048, help="bytes per text")
    parser.add_argument("--example-bytes", type=int, default=600)
    parser.add_argument("--seed", type=int, default=30000)
    parser.add_argument("--out", type=Path, default=Path("results/wgkv-admission/admission"))
    args = parser.parse_args(argv)
    model = load_hf_checkpoint(args.model)
    corpus = corpus_lib.load_corpus("heldout")
    rng = np.random.default_rng(args.seed)
    texts = [corpus.text(rng, args.length - 1) for _ in range(args.texts)]
    policy = policies.WGKV()
    command = "python -m jaxkv.benchmarks.wgkv_admission"
    report = {
        **harness.provenance(command, argv),
        "texts": args.texts,
        "length": args.length,
        "tau": policy.tau,
        "window": policy.window,
        "gates": {},
    }
    all_shares = {}
    for path in args.gates:
        gates = load_write_gates(path, model.config)
        shares, positions = admitted_shares(model, gates, texts, policy)
        row = summarize(shares)
        row["example"] = example(shares, positions, texts, args.example_bytes)
        report["gates"][path.name] = row
        all_shares[path.name] = shares
    harness.save(args.out.parent, args.out.name, report, markdown(report))
    plot(report, all_shares, args.out.with_suffix(".png"))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
