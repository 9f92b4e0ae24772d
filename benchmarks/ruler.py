"""RULER's synthetic tasks on any model jaxkv loads, every policy at kvpress's compression ratios.

    jaxkv bench ruler --model smollm2-135m-instruct --length 4096 --samples 20 \
        --policies full kvzip snapkv --ratios 0.5 0.25 0.75 0.875 \
        --out results/ruler/smollm2-135m-instruct-4k

Samples (`ruler_tasks`: 11 tasks, RULER's QA tasks left out) are generated offline from
`--seed` in the model's tokenizer and chat template, each prompt with its answer tokens within
`--length`; every policy reads the same token ids. A compression ratio r is kvpress's: the share
of the prompt evicted, a jaxkv budget of 1 - r. Settings (kvpress's):
  agnostic  the context alone (instructions and haystack) is prefilled and compressed
            (`jaxkv.prefill`), then the question read over the compressed cache and the answer
            decoded greedily (`jaxkv.decode(session.extend(question))`);
  aware     the context and the question (the user's turn) are compressed together, then the
            rest (the end of the turn, the assistant header, the answer prefix) read over it
            as kvpress's pipeline reads it, for the policies of `--aware-policies` (those
            kvpress's leaderboard runs query-aware: SnapKV, AdaKV over SnapKV, FINCH and
            ChunkKV). FINCH's question window is the sample's question (`window`: kvpress's
            delimiter), so it runs aware only unless its entry gives one.
The full cache answers the same in both: it runs once, as ratio 0 agnostic. WG-KV has a
threshold, not a budget: its tau for each ratio is calibrated on the first sample of the first
task (`wgkv_calibration`: within 0.02 of 1 - ratio, never more bytes than the ratio allows;
`wgkv-calibration.json`). Records carry each sample's own bytes: the leaderboard's `kept`
column is the share WG-KV held across the samples. OUT holds one model, length, seed and
answer cap: a command that differs in one of them from OUT/run.json's is refused.

The forward pass over a 4K prompt is most of a sample's cost, so a sample's pending jobs
(ratios and policies) whose prefills read alike (`read_groups.prefill_classes`: no budget
read during prefill, so not WG-KV's thresholds nor Fast KVzip's chunk eviction; the same
forward pass) run together, in either setting: what the setting compresses (the context, or
the context and the question) read once, then compressed by each policy at each ratio
(`jaxkv.prefill_each`; each the same kept tokens as its own prefill), and each answer decoded
from its own copy.
Decoding is then most of the
cost, and on a CPU a decode step reads every weight whatever the batch: the answers of the
policies that do nothing while decoding (all here but StreamingLLM, which evicts every 32
steps) are decoded as the rows of one session per ratio (`jaxkv.generation.joined`), each
row's tokens its own: a step reads every row as far as the longest row holds, so rows of one
ratio join and no other. A record's seconds are its own compression and answer plus an equal
share of the read (`prefill_shared_by` jobs) and of its decode (`decoded_with` rows).

Each answered sample is a line of OUT/records.jsonl as soon as it finishes: a rerun of the
command skips every (task, sample, policy, ratio, setting) already there. OUT/samples.jsonl is
the samples' export (text and token ids, for `kvpress_reference --ruler`). Reports (rewritten at
the end, or with --render alone): kvpress's leaderboard layout (`ruler_report`), the plot, and
with --against the table of jaxkv minus kvpress.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness, ruler_report, score_ties, wgkv_calibration
from jaxkv.benchmarks.read_groups import job_groups, prefill_classes, reads_once
from jaxkv.benchmarks.ruler_tasks import (
    AWARE_POLICIES,
    DEFAULT_SEED,
    RATIOS,
    SETTINGS,
    TASKS,
    Sample,
    answer_token_span,
    build_sample,
    cells,
    prediction,
    sample_from_json,
    string_match_all,
)
from jaxkv.generation import extend_with_logits
from jaxkv.generation.joined import decode_ready, join_refusal, join_sessions
from jaxkv.model_sources import load_model, model_file_sha256, stop_tokens
from jaxkv.policies import Policy

# What a run's directory holds one of (OUT/run.json's key: the option that sets it).
RUN_IDENTITY = {
    "file_sha256": "--model",
    "length": "--length",
    "seed": "--seed",
    "max_new_tokens": "--max-new-tokens",
}


def load_samples(tokenizer, tasks, length: int, count: int, seed: int, out: Path) -> dict:
    """{(task, index): Sample}: those OUT/samples.jsonl holds for this (length, seed), the rest
    generated and appended to it."""
    path = out / "samples.jsonl"
    found = {}
    for record in ruler_report.read_jsonl(path):
        if (record.get("length"), record.get("seed")) == (length, seed):
            found[(record["task"], record["index"])] = sample_from_json(record)
    wanted = [(t, i) for i in range(count) for t in tasks if (t, i) not in found]
    for task, index in tqdm(wanted, desc="samples", unit="sample", disable=not wanted):
        found[(task, index)] = build_sample(tokenizer, task, length, index, seed)
        line = {**found[(task, index)].to_json(), "length": length, "seed": seed}
        ruler_report.append_record(path, line)
    return found


def answer(
    model, tokenizer, policy, params, sample: Sample, setting: str, stop, cap: int | None = None
) -> dict:
    """One sample under one policy and setting: the prediction, its score, the bytes held
    (answer tokens: the task's, at most `cap`)."""
    sample = sample.capped(cap)
    start = time.perf_counter()
    compressed, after = sample.split(setting)
    session = jaxkv.prefill(
        model,
        [compressed],
        policy,
        reserve_tokens=len(after) + sample.max_new_tokens,
        policy_params=params,
    )
    held = float(session.memory_bytes())  # what the setting compressed
    out = jaxkv.decode(session.extend([after]), sample.max_new_tokens, stop_tokens=stop)
    return scored(tokenizer, sample, out, held, stop, start)


def answers_each(
    model, tokenizer, chosen, ratios, sample: Sample, setting: str, stop, cap=None
) -> list[dict]:
    """`answer` in `setting` under each of `chosen` ((policy, params) pairs whose prefills read
    alike: `jaxkv.prefill_each`) at its ratio in `ratios`, what the setting compresses read
    once; the answers of the policies that do nothing while decoding at one ratio decoded as
    the rows of one session (`join_sessions`: each row's tokens its own; one per set of
    sessions that can join). Only one ratio's rows join: a decode step reads every row as far
    as its longest row holds (the XLA path), so a row of ratio 0.875 joined with one of 0.25
    would read three quarters of a context to hold an eighth of it. Each result's seconds are
    its own compression and answer plus an equal share of the read and of its decode;
    `decoded_with` counts the rows of that decode."""
    sample = sample.capped(cap)
    start = time.perf_counter()
    compressed, after = sample.split(setting)
    sessions = jaxkv.prefill_each(
        model,
        [compressed],
        [policy for policy, _ in chosen],
        reserve_tokens=len(after) + sample.max_new_tokens,
        policy_params=[params for _, params in chosen],
    )
    share = (time.perf_counter() - start) / len(chosen)
    results, joins = [None] * len(chosen), []
    for index in range(len(chosen)):
        started = time.perf_counter() - share
        session = next(sessions)
        held = float(session.memory_bytes())  # what the setting compressed
        session = session.extend([after])
        if join_refusal([session]) is None:
            ready = decode_ready(session, sample.max_new_tokens)
            waiting = (index, held, ready, time.perf_counter() - started)
            join = next((j for j in joins if joins_with(j, index, ready, ratios)), None)
            if join is None:
                joins.append([waiting])
            else:
                join.append(waiting)
            continue
        out = jaxkv.decode(session, sample.max_new_tokens, stop_tokens=stop)
        results[index] = {**scored(tokenizer, sample, out, held, stop, started), "decoded_with": 1}
    for join in joins:  # one ratio's sessions that one decode can join (`joins_with`)
        started = time.perf_counter()
        joined = join_sessions([ready for _, _, ready, _ in join], sample.max_new_tokens)
        out = jaxkv.decode(joined, sample.max_new_tokens, stop_tokens=stop)
        decode_share = (time.perf_counter() - started) / len(join)
        for row, (index, held, _, own) in enumerate(join):
            began = time.perf_counter() - own - decode_share
            result = scored(tokenizer, sample, out, held, stop, began, row=row)
            results[index] = {**result, "decoded_with": len(join)}
    return [{**result, "prefill_shared_by": len(chosen)} for result in results]


def joins_with(join: list[tuple], index: int, ready, ratios) -> bool:
    """Whether `answers_each`'s job `index`, decode-ready as `ready`, joins `join` (waiting
    jobs' (index, held, ready, seconds)): its ratio theirs, and `join_refusal` none."""
    first, _, first_ready, _ = join[0]
    return ratios[first] == ratios[index] and join_refusal([first_ready, ready]) is None


def scored(tokenizer, sample: Sample, out, held: float, stop, start: float, row: int = 0) -> dict:
    """The record of the answer in row `row` of `out`: prediction, RULER's score, bytes held,
    seconds since start."""
    predicted = prediction(tokenizer, out.tokens[row][: int(out.num_tokens[row])], stop)
    return {
        "prediction": predicted,
        "score": string_match_all(predicted, sample.outputs),
        "outputs": list(sample.outputs),
        "kv_bytes": held,
        "context_tokens": len(sample.context_ids),
        "prompt_tokens": len(sample.context_ids) + len(sample.question_ids),
        "seconds": round(time.perf_counter() - start, 2),
    }


def sample_options(name: str, options: dict, sample: Sample) -> dict:
    """`options` with what policy `name` takes from the sample: FINCH's question window (the
    question's tokens, where kvpress puts its delimiter) unless the entry gives one."""
    if name == "finch" and "window" not in options:
        return {**options, "window": sample.question_turn_tokens}
    return options


def check_settings(parsed: dict, settings) -> None:
    """SystemExit for FINCH in the agnostic setting without a window: its window is the
    question, which that setting reads after the compression."""
    for entry, (name, options) in parsed.items():
        if name == "finch" and "window" not in options and "agnostic" in settings:
            raise SystemExit(
                f"--policies {entry}: FINCH scores with the question, which the agnostic setting "
                "reads after compressing: give --settings aware, or finch:window=N"
            )


def render(out: Path, against: Path | None = None) -> str:
    """The reports of OUT/records.jsonl (and, --against, jaxkv minus kvpress)."""
    run = json.loads((out / "run.json").read_text())
    records = ruler_report.load_records(out / "records.jsonl")
    tasks = [t for t in TASKS if any(r["task"] == t for r in records)]
    rows = ruler_report.leaderboard(records, tasks)
    ruler_report.write_cells(records, out, "ruler", run)
    text = ruler_report.write_leaderboard(rows, tasks, out, run)
    if rows:
        ruler_report.plot(rows, out, run["title"])
    if against is not None:
        theirs = ruler_report.load_records(against)
        table = ruler_report.versus_kvpress(records, theirs, tasks)
        (out / "versus-kvpress.md").write_text(f"# jaxkv minus kvpress (x100)\n\n{table}")
        text += "\n" + table
    return text


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxkv bench ruler", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=4096, help="context tokens, answer included")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--policies", nargs="+", default=["full", "snapkv"])
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument(
        "--aware-policies",
        nargs="+",
        default=list(AWARE_POLICIES),
        choices=policies.registered(),
        metavar="POLICY",
        help="the policies run query-aware (kvpress's leaderboard's by default)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="answer tokens at most (default: RULER's per task: 128 NIAH, 30 vt, 120 cwe, 50 fwe)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--export-only", action="store_true", help="write samples.jsonl only")
    parser.add_argument("--render", action="store_true", help="rewrite the reports, run nothing")
    parser.add_argument("--against", type=Path, help="kvpress's records.jsonl to compare with")
    parser.add_argument(
        "--kept",
        metavar="TASK:INDEX",
        help="run nothing else: where each cell's policy leaves that sample's answer tokens, "
        "and its greedy answer's closest call (OUT/kept-TASK-INDEX.md, .json)",
    )
    args = parser.parse_args(argv)
    if args.kept is not None:
        task, _, index = args.kept.partition(":")
        if task not in TASKS or not index.isdigit():
            raise SystemExit(f"--kept {args.kept}: TASK:INDEX, TASK one of {', '.join(TASKS)}")
        args.kept = (task, int(index))
    harness.check_ratios(args.ratios)
    if args.samples < 1:
        raise SystemExit(f"--samples {args.samples}: at least 1")
    if args.out is None:
        args.out = Path("results/ruler") / f"{Path(args.model).stem}-{args.length // 1024}k"
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_arguments(argv)
    if args.render:
        text = render(args.out, args.against)
        print(text)
        return {"report": text}
    parsed = harness.parse_ratio_policies(args.policies)
    check_settings(parsed, args.settings)
    model, tokenizer = load_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kept is not None:
        return {"report": kept_report(args, argv, parsed, model, tokenizer)}
    run = start_run(args, argv)
    samples = load_samples(tokenizer, args.tasks, args.length, args.samples, args.seed, args.out)
    if args.export_only:
        return {"samples": len(samples)}
    params = harness.shipped_params_of(parsed, model, args.model)
    jobs = pending_jobs(args, parsed)
    taus = {  # WG-KV's, calibrated on the first sample of the first task
        entry: wgkv_calibration.calibrate(
            model,
            params[entry],
            samples[(args.tasks[0], 0)],
            args.ratios,
            args.out,
            entry,
            parsed[entry][1],
            run["provenance"],
        )
        for entry in {job[0] for job in jobs if parsed[job[0]][0] == "wgkv"}
    }
    jobs = without_superseded(jobs, taus)
    policy_at = PolicyBuilder(parsed, taus, tokenizer)
    shared = [entry for entry, (name, options) in parsed.items() if reads_once(name, options)]
    first = (args.ratios[0], samples[(args.tasks[0], 0)])
    classes = prefill_classes({e: (policy_at(e, *first), params[e]) for e in shared})
    stop = stop_tokens(tokenizer, model.config)
    progress = tqdm(total=len(jobs), desc="ruler", unit="sample")
    for group in job_groups(jobs, classes):
        _, _, setting, task, index = group[0]
        sample = samples[(task, index)]
        chosen = [(policy_at(entry, ratio, sample), params[entry]) for entry, ratio, *_ in group]
        if len(group) > 1:
            ratios = [ratio for _, ratio, *_ in group]
            results = answers_each(
                model, tokenizer, chosen, ratios, sample, setting, stop, args.max_new_tokens
            )
        else:
            results = [
                answer(model, tokenizer, *chosen[0], sample, setting, stop, args.max_new_tokens)
            ]
        for (entry, ratio, *_), result in zip(group, results, strict=True):
            record = {"task": task, "index": index, "policy": entry, "ratio": ratio}
            record = {**record, "setting": setting, **result}
            record["compressed_tokens"] = len(sample.split(setting)[0])
            if parsed[entry][0] == "wgkv":
                record["tau"] = taus[entry][ratio]
            ruler_report.append_record(args.out / "records.jsonl", record)
        progress.update(len(group))
    progress.close()
    text = render(args.out, args.against)
    print(text)
    return {"report": text}


def kept_answer(
    model, tokenizer, policy, params, sample: Sample, setting: str, stop, steps: int
) -> dict:
    """Where `policy` leaves `sample`'s answers once what `setting` compresses is compressed:
    per answer (`answer_token_span`; why not, for an answer the context holds more than once),
    its tokens and how many of the (layer, KV head) pairs keep each, and the layers in which
    every head keeps all of them; then the first `steps` greedy answer tokens (read on by
    `extend_with_logits`, the prefill path), each with its logit and the runner-up's; and the
    heads whose cut falls among tied scores (`score_ties.ties_at_cut`; None for a policy
    that ranks no scores)."""
    compressed, after = sample.split(setting)
    session = jaxkv.prefill(
        model, [compressed], policy, reserve_tokens=len(after) + steps, policy_params=params
    )
    positions = np.asarray(session.kv.positions())[:, 0]  # [L, K, S], -1 padded
    answers = []
    for output in sample.outputs:
        try:
            span = answer_token_span(tokenizer, sample, output)
        except ValueError as error:  # an answer the context holds more than once: no span
            answers.append({"answer": output, "no_span": str(error)})
            continue
        kept = np.stack([(positions == p).any(-1) for p in span], -1)  # [L, K, tokens]
        answers.append(
            {
                "answer": output,
                "positions": list(span),
                "tokens": [tokenizer.decode([sample.context_ids[p]]) for p in span],
                "kept_by": kept.sum((0, 1)).tolist(),
                "whole_in_layers": [int(i) for i in np.flatnonzero(kept.all((1, 2)))],
            }
        )
    held = float(session.memory_bytes())
    greedy, read = [], list(after)
    for _ in range(steps):
        session, logits = extend_with_logits(session, [read])
        logits = np.asarray(logits[0, len(read) - 1])
        first, second = (int(t) for t in np.argsort(logits)[::-1][:2])
        greedy.append(
            {
                "token": tokenizer.decode([first]),
                "logit": float(logits[first]),
                "runner_up": tokenizer.decode([second]),
                "runner_up_logit": float(logits[second]),
            }
        )
        if first in stop:
            break
        read = [first]
    pairs = positions.shape[0] * positions.shape[1]
    ties = score_ties.ties_at_cut(model, policy, params, compressed)
    return {"pairs": pairs, "kv_bytes": held, "answers": answers, "greedy": greedy, "ties": ties}


def ties_text(ties: list[dict] | None) -> str:
    """`kept_answer`'s ties in a few words: how many heads cut among ties, the tokens tied
    and kept there, and the head with the most tied tokens left out."""
    if ties is None:
        return ""
    if not ties:
        return "none"
    most = max(ties, key=lambda t: t["tied"] - t["tied_kept"])
    tied, kept = (sum(t[key] for t in ties) for key in ("tied", "tied_kept"))
    return (
        f"{len(ties)} heads, {kept} of {tied} tied tokens kept; most: layer {most['layer']} "
        f"head {most['head']}, {most['tied_kept']} of {most['tied']} at {most['cut']:.6g} "
        f"({most['zeros']} of its {most['ranked']} ranked tokens score 0)"
    )


def closest_call(greedy: list[dict]) -> str:
    """The greedy step whose top two logits are nearest, as text."""
    step = min(range(len(greedy)), key=lambda i: greedy[i]["logit"] - greedy[i]["runner_up_logit"])
    call = greedy[step]
    return (
        f"step {step + 1}: {call['token']!r} {call['logit']:.6f} vs {call['runner_up']!r} "
        f"{call['runner_up_logit']:.6f}"
    )


def kept_report(args: argparse.Namespace, argv: list[str], parsed, model, tokenizer) -> str:
    """--kept TASK:INDEX: `kept_answer` for every cell of the command (WG-KV at the taus the
    sweep calibrated; the task's answer tokens, at most --max-new-tokens), merged into
    OUT/kept-TASK-INDEX.json (a cell's row replaced; the commands listed) and .md."""
    task, index = args.kept
    sample = build_sample(tokenizer, task, args.length, index, args.seed)
    taus = {
        entry: wgkv_calibration.saved_taus(
            wgkv_calibration.calibration_path(args.out, entry), args.ratios
        )
        for entry, (name, _) in parsed.items()
        if name == "wgkv"
    }
    policy_at = PolicyBuilder(parsed, taus, tokenizer)
    stop = stop_tokens(tokenizer, model.config)
    steps = sample.capped(args.max_new_tokens).max_new_tokens
    params = harness.shipped_params_of(parsed, model, args.model)
    rows = []
    entries = {entry: name for entry, (name, _) in parsed.items()}
    for entry, ratio, setting in cells(entries, args.ratios, args.settings, args.aware_policies):
        policy = policy_at(entry, ratio, sample)
        found = kept_answer(model, tokenizer, policy, params[entry], sample, setting, stop, steps)
        rows.append({"policy": entry, "ratio": ratio, "setting": setting, **found})
    path = args.out / f"kept-{task}-{index}.json"
    previous = json.loads(path.read_text())["rows"] if path.exists() else []
    fresh = {(r["policy"], r["ratio"], r["setting"]) for r in rows}
    rows = [r for r in previous if (r["policy"], r["ratio"], r["setting"]) not in fresh] + rows
    report = {
        "provenance": harness.provenance("jaxkv bench ruler", argv),
        "commands": harness.commands_so_far(path, "jaxkv bench ruler " + " ".join(argv)),
        "rows": rows,
    }
    text = kept_markdown(f"{task} #{index}", args.length, report)
    harness.save(args.out, path.stem, report, text)
    print(text)
    return text


def kept_markdown(sample_name: str, length: int, report: dict) -> str:
    """`kept_report`'s rows as a markdown table, under the commands that ran them."""
    lines = [
        f"# Where each policy leaves {sample_name}'s answer ({length} tokens)",
        "",
        "Each answer token: how many of the (layer, KV head) pairs keep it. The greedy answer "
        "(read on by `extend_with_logits`) and its closest call: the step whose top two "
        "logits are nearest. Ties at the cut: the heads whose lowest kept score is shared "
        f"(to a relative {score_ties.TIE_TOLERANCE:g}) with tokens they leave out, which the "
        "sort's tie-break chose "
        "(`benchmarks/score_ties.py`; blank: not examined, or a policy ranking no scores). "
        "The commands (a rerun of a cell replaces its row):",
        "",
        *(f"    {command}" for command in report["commands"]),
        "",
        "| policy | ratio | setting | MB held | answer | tokens: kept by | whole in layers "
        "| greedy answer | closest call | ties at the cut |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        answer_text = "".join(step["token"] for step in row["greedy"])
        for found in row["answers"]:
            if "no_span" in found:
                kept, layers = "(not held once)", ""
            else:
                kept = ", ".join(
                    f"{token!r} {count}/{row['pairs']}"
                    for token, count in zip(found["tokens"], found["kept_by"], strict=True)
                )
                layers = f"{len(found['whole_in_layers'])}: {found['whole_in_layers']}"
            lines.append(
                f"| {row['policy']} | {row['ratio']:.3g} | {row['setting']} | "
                f"{row['kv_bytes'] / 1e6:.1f} | {found['answer']} | {kept} | {layers} | "
                f"{answer_text!r} | {closest_call(row['greedy'])} | "
                f"{ties_text(row.get('ties'))} |"
            )
    return "\n".join(lines) + "\n"


def start_run(args: argparse.Namespace, argv: list[str]) -> dict:
    """OUT/run.json for this command: the title, provenance, every command run into OUT so
    far, the model (and its file's hash), length, seed and answer cap. SystemExit when OUT's
    run.json has another model, length, seed or cap (`RUN_IDENTITY`): its records would be
    skipped as done."""
    run_path = args.out / "run.json"
    run = {
        "title": f"RULER (synthetic) on {Path(args.model).stem} at {args.length} tokens",
        "provenance": harness.provenance("jaxkv bench ruler", argv),
        "commands": harness.commands_so_far(run_path, "jaxkv bench ruler " + " ".join(argv)),
        "model": args.model,
        "model_name": Path(args.model).stem,
        "file_sha256": model_file_sha256(args.model),
        "length": args.length,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
    }
    harness.check_same_run(run_path, run, RUN_IDENTITY)
    harness.save(args.out, "run", run)
    return run


def pending_jobs(args: argparse.Namespace, parsed: dict) -> list[tuple]:
    """(entry, ratio, setting, task, index) of every cell's samples that OUT/records.jsonl
    lacks, in run order (`cells`, then sample, then task)."""
    records = ruler_report.load_records(args.out / "records.jsonl")
    done = {ruler_report.record_key(r) for r in records}
    entries = {entry: name for entry, (name, _) in parsed.items()}
    return [
        (entry, ratio, setting, task, index)
        for entry, ratio, setting in cells(entries, args.ratios, args.settings, args.aware_policies)
        for index in range(args.samples)
        for task in args.tasks
        if (task, index, entry, ratio, setting) not in done
    ]


def without_superseded(jobs: list[tuple], taus: dict) -> list[tuple]:
    """`jobs` less WG-KV's at a ratio whose calibrated tau is a larger ratio's
    (`superseded_ratios`: run at the larger one only), said on stderr."""
    for entry, entry_taus in taus.items():
        for ratio, larger in wgkv_calibration.superseded_ratios(entry_taus).items():
            print(
                f"{entry}: ratio {ratio} (keep {1 - ratio:.0%}) gets ratio {larger}'s tau "
                f"({entry_taus[ratio]:.3g}), no tau keeping a share between: run at {larger} "
                "only",
                file=sys.stderr,
            )
            jobs = [job for job in jobs if job[:2] != (entry, ratio)]
    return jobs


class PolicyBuilder:
    """`builder(entry, ratio, sample)`: the policy of `--policies` entry at `ratio` for
    `sample` (WG-KV at its calibrated tau, the others at budget 1 - ratio, FINCH's window the
    sample's question), for the tokenizer; each built once."""

    def __init__(self, parsed: dict, taus: dict, tokenizer):
        self.parsed, self.taus, self.tokenizer = parsed, taus, tokenizer
        self.built: dict[tuple, Policy] = {}

    def __call__(self, entry: str, ratio: float, sample: Sample) -> Policy:
        name, options = self.parsed[entry]
        options = sample_options(name, options, sample)
        key = (entry, ratio, options.get("window"))
        if key not in self.built:
            tau = self.taus[entry][ratio] if name == "wgkv" else None
            policy = harness.policy_at_ratio(name, options, ratio, tau)
            self.built[key] = policy.for_tokenizer(self.tokenizer)
        return self.built[key]


if __name__ == "__main__":
    main()
