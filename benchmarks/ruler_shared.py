"""Shared context, many questions (SCBench's shape): each context compressed once, then questions
of different tasks (retrieval, multi-hop variable tracking, aggregation) asked over it through
`jaxkv.ask` (the rows share the compressed context's pages); scores per question kind and
position, and the bytes held, per policy and compression ratio.

    jaxkv bench ruler_shared --model smollm2-135m-instruct --length 4096 --contexts 8 \
        --questions 6 --policies full snapkv kvzip --ratios 0.5 \
        --out results/ruler-shared/smollm2-135m-instruct-4k

Contexts: `shared_context_tasks` (prose with four needles, a four-hop variable chain and a word
list; question q of context c asks kind (q + c) mod 8 of its rota, so positions see every kind
alike). `jaxkv.ask` answers each question alone over the one compressed copy (no earlier question
or answer in its cache), so a position's score differs from another's only through the kinds asked
there. Bytes: the context's pages held once (`AskOutput.shared_bytes`) and all rows together
(`total_bytes`). WG-KV's tau per ratio comes from `--wgkv-calibration` (the file `jaxkv bench
ruler` writes, `wgkv_calibration`). A policy that evicts while decoding cannot share pages: `ask`
refuses it, and the cell is reported as skipped before anything runs. Each context is read once for
the policies and ratios whose prefills read alike (`jaxkv.prefill_each`, as `jaxkv bench ruler`
groups them), then compressed and asked by each. Records: OUT/records.jsonl, one line per question
as each (cell, context) finishes; a rerun skips the (cell, context) pairs with every question's
record (OUT holds one model, length and question count: a command that differs in one of them is
refused).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv.benchmarks import harness, ruler_report, wgkv_calibration
from jaxkv.benchmarks.read_groups import job_groups, prefill_classes, reads_once
from jaxkv.benchmarks.ruler_tasks import prediction
from jaxkv.benchmarks.shared_context_tasks import (
    ANSWER_TOKENS,
    QUESTION_KINDS,
    SharedContext,
    build_shared_context,
    score,
)
from jaxkv.generation.decoding import check_shared_decode
from jaxkv.model_sources import load_model, model_file_sha256, stop_tokens

# Seeds the compression of policies that draw random numbers, read alone or with others.
COMPRESSION_KEY = jax.random.PRNGKey(0)
# What a run's directory holds one of (OUT/run.json's key: the option that sets it).
RUN_IDENTITY = {"file_sha256": "--model", "length": "--length", "questions": "--questions"}


def ask_context(model, tokenizer, context: SharedContext, stop, session) -> list[dict]:
    """One context's questions through `jaxkv.ask` over `session` (the context compressed): a
    record per question (its position), without its seconds."""
    out = jaxkv.ask(
        model,
        session,
        [list(q) for q in context.questions],
        max_new_tokens=ANSWER_TOKENS,
        stop_tokens=stop,
    )
    records = []
    for position, (row, count) in enumerate(
        zip(out.answers.tokens, out.answers.num_tokens, strict=True)
    ):
        predicted = prediction(tokenizer, row[: int(count)], stop)
        outputs = context.outputs[position]
        records.append(
            {
                "task": context.kinds[position],
                "index": context.index * 16 + position,
                "context": context.index,
                "position": position,
                "prediction": predicted,
                "outputs": list(outputs),
                "score": score(predicted, outputs),
                "kv_bytes": float(out.shared_bytes),
                "total_bytes": float(out.total_bytes),
                "separate_bytes": float(out.separate_bytes),
            }
        )
    return records


def ask_cells(model, tokenizer, context: SharedContext, stop, chosen) -> list[list[dict]]:
    """`ask_context` under each of `chosen` ((policy, params) pairs; several only where their
    prefills read alike: the context read once, `jaxkv.prefill_each`). Each cell's records
    carry an equal share of the whole's seconds."""
    start = time.perf_counter()
    ids = [list(context.context_ids)]
    if len(chosen) == 1:
        (policy, params), *_ = chosen
        sessions = iter(
            [jaxkv.prefill(model, ids, policy, key=COMPRESSION_KEY, policy_params=params)]
        )
    else:
        sessions = jaxkv.prefill_each(
            model,
            ids,
            [policy for policy, _ in chosen],
            key=COMPRESSION_KEY,
            policy_params=[params for _, params in chosen],
        )
    results = [ask_context(model, tokenizer, context, stop, next(sessions)) for _ in chosen]
    seconds = round((time.perf_counter() - start) / len(chosen), 2)
    return [[{**record, "seconds": seconds} for record in records] for records in results]


def summary(records: list[dict]) -> list[dict]:
    """Per (policy, ratio): mean score (x100) per kind and per position, and bytes held."""
    full = {r["context"]: r["kv_bytes"] for r in records if r["policy"] == "full"}
    cells = defaultdict(list)
    for r in records:
        cells[(r["policy"], r["ratio"])].append(r)
    rows = []
    for (policy, ratio), found in sorted(cells.items(), key=lambda c: (c[0][0] != "full", c[0])):
        kinds, positions = defaultdict(list), defaultdict(list)
        for r in found:
            kinds[r["task"]].append(r["score"])
            positions[r["position"]].append(r["score"])
        shares = [r["kv_bytes"] / full[r["context"]] for r in found if r["context"] in full]
        rows.append(
            {
                "policy": policy,
                "compression_ratio": ratio,
                "kinds": {k: 100 * float(np.mean(v)) for k, v in sorted(kinds.items())},
                "positions": {p: 100 * float(np.mean(v)) for p, v in sorted(positions.items())},
                "average": 100 * float(np.mean([r["score"] for r in found])),
                "contexts": len({r["context"] for r in found}),
                "shared_bytes": float(np.mean([r["kv_bytes"] for r in found])),
                "total_bytes": float(np.mean([r["total_bytes"] for r in found])),
                "kept_share": float(np.mean(shares)) if shares else None,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r["kinds"]})
    positions = sorted({p for r in rows for p in r["positions"]})
    header = ["policy", "ratio", "kept", "context MB", "all rows MB", *kinds]
    header += [f"q{p + 1}" for p in positions] + ["average", "contexts"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        kept = "" if r["kept_share"] is None else f"{100 * r['kept_share']:.0f}%"
        cells = [r["policy"], f"{r['compression_ratio']:.3g}", kept]
        cells += [f"{r['shared_bytes'] / 1e6:.1f}", f"{r['total_bytes'] / 1e6:.1f}"]
        cells += [f"{r['kinds'][k]:.1f}" if k in r["kinds"] else "" for k in kinds]
        cells += [f"{r['positions'][p]:.1f}" if p in r["positions"] else "" for p in positions]
        cells += [f"{r['average']:.1f}", str(r["contexts"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(out: Path) -> str:
    run = json.loads((out / "run.json").read_text())
    rows = summary(ruler_report.load_records(out / "records.jsonl"))
    text = f"# {run['title']}\n\n{harness.provenance_line(run['provenance'])}\n\n"
    text += markdown(rows)
    if run.get("skipped"):
        text += "\nSkipped (`ask` refuses them): " + ", ".join(run["skipped"]) + "\n"
    harness.save(out, "shared", {**run, "rows": rows}, text)
    return text


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxkv bench ruler_shared", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--contexts", type=int, default=len(QUESTION_KINDS))
    parser.add_argument(
        "--questions", type=int, default=6, help="questions a context, 1-8 (SCBench asks 4-8)"
    )
    parser.add_argument("--policies", nargs="+", default=["full", "snapkv"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    parser.add_argument("--wgkv-calibration", type=Path, help="`jaxkv bench ruler`'s file")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--render", action="store_true", help="rewrite the report only")
    args = parser.parse_args(argv)
    harness.check_ratios(args.ratios)
    if not 1 <= args.questions <= len(QUESTION_KINDS):
        raise SystemExit(f"--questions {args.questions}: 1 to {len(QUESTION_KINDS)}")
    if args.out is None:
        args.out = Path("results/ruler-shared") / f"{Path(args.model).stem}-{args.length // 1024}k"
    return args


def start_run(args: argparse.Namespace, argv: list[str]) -> dict:
    """OUT/run.json's content for this command (saved with the policies `ask` refuses): the
    title, provenance, every command run into OUT so far, the model (and its file's hash),
    the length, the questions a context and the policies skipped so far. SystemExit when
    OUT's run.json has another model, length or question count (`RUN_IDENTITY`)."""
    run_path = args.out / "run.json"
    previous = json.loads(run_path.read_text()) if run_path.exists() else {}
    run = {
        "title": f"Shared context, {args.questions} questions, on {Path(args.model).stem} at "
        f"{args.length} tokens",
        "provenance": harness.provenance("jaxkv bench ruler_shared", argv),
        "commands": harness.commands_so_far(run_path, "jaxkv bench ruler_shared " + " ".join(argv)),
        "model": args.model,
        "file_sha256": model_file_sha256(args.model),
        "length": args.length,
        "questions": args.questions,
        "skipped": previous.get("skipped", []),
    }
    harness.check_same_run(run_path, run, RUN_IDENTITY)
    return run


def chosen_cells(parsed: dict, ratios, taus: dict, tokenizer, params: dict):
    """({(entry, ratio): (policy, params)} of the cells `ask` can run (the full cache once),
    ["entry: why"] of the policies it refuses (evicting while decoding)), before any read."""
    cells = [(e, 0.0) for e, (n, _) in parsed.items() if n == "full"]
    cells += [(e, r) for r in ratios for e, (n, _) in parsed.items() if n != "full"]
    chosen, refused = {}, []
    for entry, ratio in cells:
        name, options = parsed[entry]
        tau = taus[entry][ratio] if name == "wgkv" else None
        policy = harness.policy_at_ratio(name, options, ratio, tau).for_tokenizer(tokenizer)
        try:
            check_shared_decode(policy, ANSWER_TOKENS)
        except ValueError as error:
            refused.append(f"{entry}: {error}")
            continue
        chosen[(entry, ratio)] = (policy, params[entry])
    return chosen, refused


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_arguments(argv)
    if args.render:
        return {"report": render(args.out)}
    parsed = harness.parse_ratio_policies(args.policies)
    wgkv_entries = [entry for entry, (name, _) in parsed.items() if name == "wgkv"]
    if wgkv_entries and args.wgkv_calibration is None:
        raise SystemExit(f"--policies {wgkv_entries[0]}: give --wgkv-calibration with its taus")
    taus = {
        entry: wgkv_calibration.saved_taus(args.wgkv_calibration, args.ratios)
        for entry in wgkv_entries
    }
    run = start_run(args, argv)
    model, tokenizer = load_model(args.model)
    contexts = [
        build_shared_context(tokenizer, args.length, c, args.questions)
        for c in range(args.contexts)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    records_path = args.out / "records.jsonl"
    answered = Counter(
        (r["policy"], r["ratio"], r["context"]) for r in ruler_report.load_records(records_path)
    )
    done = {cell for cell, count in answered.items() if count >= args.questions}
    params = harness.shipped_params_of(parsed, model, args.model)
    chosen, refused = chosen_cells(parsed, args.ratios, taus, tokenizer, params)
    harness.save(args.out, "run", {**run, "skipped": sorted({*run["skipped"], *refused})})
    shared = {
        entry: chosen[(entry, ratio)]
        for entry, ratio in chosen
        if ratio == args.ratios[0] and reads_once(*parsed[entry])
    }
    classes = prefill_classes(shared)
    jobs = [
        (entry, ratio, "shared", "context", context.index)
        for context in contexts
        for entry, ratio in chosen
        if (entry, ratio, context.index) not in done
    ]
    stop = stop_tokens(tokenizer, model.config)
    progress = tqdm(total=len(jobs), desc="ruler_shared", unit="cell")
    for group in job_groups(jobs, classes):
        context = contexts[group[0][-1]]
        pairs = [chosen[(entry, ratio)] for entry, ratio, *_ in group]
        results = ask_cells(model, tokenizer, context, stop, pairs)
        for (entry, ratio, *_), records in zip(group, results, strict=True):
            for record in records:
                record = {**record, "policy": entry, "ratio": ratio, "setting": "shared"}
                ruler_report.append_record(records_path, record)
        progress.update(len(group))
    progress.close()
    text = render(args.out)
    print(text)
    return {"report": text}


if __name__ == "__main__":
    main()
