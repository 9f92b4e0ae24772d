"""The Conf-KV benchmark's report: the markdown tables of its parts and the plots of a
Conf-KV trace (tokens held and confidence per step) and of bits per token by length."""

from __future__ import annotations

from pathlib import Path

from jaxkv.benchmarks import harness


def plot_trace(result: dict, path: Path) -> None:
    plt = harness.pyplot()

    trace = result["trace"]
    fig, size_axis = plt.subplots(figsize=(9, 3.5))
    size_axis.plot(trace["tokens_per_head"], color="tab:blue", lw=1)
    size_axis.set_xlabel("decode step")
    size_axis.set_ylabel("tokens held per head", color="tab:blue")
    conf_axis = size_axis.twinx()
    conf_axis.plot(trace["confidence"], color="tab:orange", lw=0.6, alpha=0.7)
    conf_axis.axhline(0.7, color="tab:orange", ls=":", lw=1)
    conf_axis.set_ylabel("confidence (seq 0)", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ppl(ppl: dict, path: Path) -> None:
    plt = harness.pyplot()

    fig, axis = plt.subplots(figsize=(7, 4))
    for name, result in ppl["policies"].items():
        bins = result["bits_per_token_by_length"]
        axis.plot([b["until"] for b in bins], [b["bits"] for b in bins], marker="o", label=name)
    axis.set_xlabel("generated length (tokens)")
    axis.set_ylabel("bits per token (bin)")
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _interval(closed: dict) -> str:
    if closed["interval_90"] is None:
        return "-"
    low, high = closed["interval_90"]
    return f"{closed['share']:.2f} [{low:.2f}, {high:.2f}]"


def table(report: dict) -> str:
    lines = []
    if "ppl" in report:
        ppl = report["ppl"]
        lines += [
            f"Perplexity ({ppl['texts']} texts; share of the sliding window's and of "
            "StreamingLLM's gap to the full cache closed, with a 90% bootstrap interval over "
            "texts)",
            "",
            "| policy | bits/token | window gap closed | StreamingLLM gap closed | tokens/head | "
            "KV KiB/seq | confident |",
            "|---" * 7 + "|",
        ]
        for name, r in ppl["policies"].items():
            lines.append(
                f"| {name} | {r['bits_per_token']:.4f} | {_interval(r['gap_closed'])} | "
                f"{_interval(r['streaming_gap_closed'])} | "
                f"{r['tokens_per_head']:.0f} | {r['kv_bytes_per_sequence'] / 1024:.0f} | "
                f"{r['confident_fraction']:.2f} |"
            )
        lines.append("")
    if "needle" in report:
        lines += ["| policy | needle acc | tokens/head | KV KiB/seq |", "|---" * 4 + "|"]
        for name, r in report["needle"]["policies"].items():
            lines.append(
                f"| {name} | {r['accuracy']:.2f} | {r['tokens_per_head']:.0f} | "
                f"{r['kv_bytes_per_sequence'] / 1024:.0f} |"
            )
        lines.append("")
    if "kl" in report:
        kl = report["kl"]
        lines += [f"KL premise: Pearson r = {kl['pearson_r']:.3f} over {kl['points']} points", ""]
    if "ablation" in report:
        lines += ablation_table(report["ablation"])
    return "\n".join(lines)


def ablation_table(ablation: dict) -> list[str]:
    lines = [
        f"Ablation ({ablation['texts']} texts, {ablation['prefix']} tokens prefilled, "
        f"{ablation['continuation']} read; full cache {ablation['full']['bits_per_token']:.4f} "
        "bits per token; gap closed with a 90% bootstrap interval over texts)",
        "",
        "| row | full | window (tokens) | Conf-KV | Conf-KV tokens/head | confident | gap closed |",
        "|---" * 7 + "|",
    ]
    full = ablation["full"]["bits_per_token"]
    for name, row in ablation["rows"].items():
        confkv, window = row["confkv"], row["window"]
        lines.append(
            f"| {name} | {full:.4f} | {window['bits_per_token']:.4f} ({row['window_tokens']}) | "
            f"{confkv['bits_per_token']:.4f} | {confkv['tokens_per_head']:.1f} | "
            f"{confkv['confident_fraction']:.2f} | {_interval(row['gap_closed'])} |"
        )
    return [*lines, ""]
