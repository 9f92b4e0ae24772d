"""What streaming costs the jitted decode loop: `generate` with `on_token` (every step's tokens
called back from inside the `lax.while_loop`) against without, on one model, in one process.

    jaxkv bench streaming --out results/streaming

Each setting runs `--repeats` times after a compiling call; reported: decode tokens per second
(`GenerateOutput.tokens_per_second`) per run, their medians, and the ratio streamed / plain.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import jaxkv
from jaxkv import bundled
from jaxkv.benchmarks import harness
from jaxkv.model_sources import load_model
from jaxkv.prose import prose


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench streaming", description=__doc__)
    parser.add_argument("--model", default=str(bundled.REFERENCE_MODEL))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/streaming"))
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    prompt = tokenizer.encode(prose(args.prompt_tokens * 8))[: args.prompt_tokens]
    received = []

    def run(on_token) -> float:
        out = jaxkv.generate(
            model,
            [prompt] * args.batch,
            max_new_tokens=args.new_tokens,
            stop_tokens=(),
            on_token=on_token,
        )
        return out.tokens_per_second

    def stream(step, tokens, done) -> None:
        received.append(step)

    settings = {"plain": None, "streamed": stream}
    for on_token in settings.values():
        run(on_token)  # compiles
    runs = {name: [] for name in settings}
    for _ in range(args.repeats):  # interleaved, so that load drifts hit both alike
        for name, on_token in settings.items():
            runs[name].append(run(on_token))
    medians = {name: float(np.median(values)) for name, values in runs.items()}
    report = {
        "provenance": harness.provenance("jaxkv bench streaming", argv),
        "model": args.model,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "decode_tokens_per_second": runs,
        "median_decode_tokens_per_second": medians,
        "streamed_over_plain": medians["streamed"] / medians["plain"],
        "tokens_called_back": len(received),
    }
    harness.save(args.out, "streaming", report)
    print(
        f"{harness.provenance_line(report['provenance'])}\n"
        f"decode tokens/s, median of {args.repeats}: plain {medians['plain']:.1f}, streamed "
        f"{medians['streamed']:.1f} (x{report['streamed_over_plain']:.3f})"
    )
    return report


if __name__ == "__main__":
    main()
