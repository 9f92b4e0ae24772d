"""`jaxkv generate` against transformers on the same pretrained model, prompt and machine.

Both load the same GGUF file (f32 weights), take the same prompt (Python docs prose, greedy) and
generate a fixed number of tokens (no early stop). Per-token decode time is the slope between
two generation lengths, so it excludes prefill and set-up; prefill is the time of a one-token
generation. jaxkv runs through the public `jaxkv.generate` (full cache, backend "xla"), each
length compiled by a first call and then timed; transformers runs `model.generate` under
`torch.no_grad()` with as many threads as the machine has cores. The result is the ratio, in
one run on one machine.

    jaxkv bench vs_transformers --model smollm2-135m-instruct --prompt-tokens 1024 \
        --out results/vs-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import jax

import jaxkv
from jaxkv import downloads, policies
from jaxkv.benchmarks import harness
from jaxkv.models import gguf_tokenizer, load_gguf
from jaxkv.prose import prose


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_jaxkv(model, prompt: list[int], lengths: tuple[int, ...], repeats: int) -> dict:
    def run(n):
        out = jaxkv.generate(
            model, [prompt], max_new_tokens=n, policy=policies.get("full"), stop_tokens=[]
        )
        jax.block_until_ready(out.tokens)
        assert int(out.num_tokens[0]) == n
        return out

    times = {}
    for n in lengths:
        run(n)  # compile
        times[n] = _best_time(lambda n=n: run(n), repeats)
    return times


def time_transformers(path: Path, prompt: list[int], lengths: tuple[int, ...], repeats: int):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    tokens = torch.tensor([prompt])

    def run(n):
        with torch.no_grad():
            out = model.generate(
                tokens, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
            )
        assert out.shape[1] == len(prompt) + n

    run(lengths[0])  # warm up
    return {n: _best_time(lambda n=n: run(n), repeats) for n in lengths}


def _slope(times: dict[int, float]) -> float:
    (n1, t1), (n2, t2) = sorted(times.items())[:1] + sorted(times.items())[-1:]
    return (t2 - t1) / (n2 - n1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jaxkv bench vs_transformers", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known model's name")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--new-tokens", type=int, nargs=2, default=[1, 33], metavar=("N1", "N2"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/vs-transformers"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    path = downloads.model_path(args.model)
    model, tokenizer = load_gguf(path), gguf_tokenizer(path)
    lengths = tuple(args.new_tokens)
    provenance = harness.provenance("jaxkv bench vs_transformers", argv)  # the load at start
    rows = []
    for prompt_tokens in args.prompt_tokens:
        prompt = tokenizer.encode(prose(8 * prompt_tokens))[:prompt_tokens]
        ours = time_jaxkv(model, prompt, lengths, args.repeats)
        theirs = time_transformers(path, prompt, lengths, args.repeats)
        row = {
            "prompt_tokens": prompt_tokens,
            "jaxkv_seconds": {str(n): t for n, t in ours.items()},
            "transformers_seconds": {str(n): t for n, t in theirs.items()},
            "jaxkv_ms_per_token": 1e3 * _slope(ours),
            "transformers_ms_per_token": 1e3 * _slope(theirs),
        }
        row["decode_speedup"] = row["transformers_ms_per_token"] / row["jaxkv_ms_per_token"]
        row["prefill_speedup"] = theirs[lengths[0]] / ours[lengths[0]]
        rows.append(row)
        print(json.dumps(row))
    report = {
        **provenance,
        "model": args.model,
        "file_sha256": downloads.KNOWN_MODELS[args.model].sha256,
        "load_average_at_end": os.getloadavg(),
        "new_tokens": lengths,
        "rows": rows,
    }
    lines = [
        "| prompt tokens | jaxkv ms/token | transformers ms/token | decode speed-up | "
        "prefill speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['prompt_tokens']} | {row['jaxkv_ms_per_token']:.1f} | "
            f"{row['transformers_ms_per_token']:.1f} | {row['decode_speedup']:.2f}x | "
            f"{row['prefill_speedup']:.2f}x |"
        )
    harness.save(args.out, "vs-transformers", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
