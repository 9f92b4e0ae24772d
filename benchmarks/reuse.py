"""Compress once, ask many: `jaxkv.ask` (one compressed context, one row per question sharing its
pages) against one `generate` per question, on a real model.

    jaxkv bench reuse --model smollm2-135m-instruct --policies kvzip:0.3 --length 2048 \
        --questions 8 --storages model int8 int8:32 --out results/reuse

The document is prose with one 7-digit needle per question at evenly spread depths
(`needles.build_document`), in the model's chat format; each question asks for one needle.
Each policy runs with each storage (`--storages`: `model`, the model dtype; `int8`, Conf-KV's
int8 tier for all but each head's newest 128 tokens; `int8:F`, its newest F). Forked rows share
the int8 tier's pages and copy the window (`jaxkv.cache.sharing`). Reported, all from one process:
  bytes   what `ask` holds after decoding (the shared context once, each row its own pages)
          against one compressed context plus the questions' and answers' tokens (the bound),
          and against one copy of the compressed context per question;
  time    wall time of `ask` against the questions' `generate` calls (question-aware: each
          compresses its own context + question), each timed warm (after a call that compiles)
          and cold (the first call, compiling);
  answers each answer's exact match in both settings, and whether each `ask` answer equals the
          question asked alone over the same compressed context (`decode(session.extend(q))`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.needles import ANSWER_TOKENS, build_document, score
from jaxkv.model_sources import load_model


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _separate(
    model, document, policy, stop, params, cache
) -> tuple[list[np.ndarray], float, float]:
    """Each question's answer by its own `generate` call; (answers, warm seconds, cold seconds
    of the first call)."""

    def one(question):
        out = jaxkv.generate(
            model,
            [list(document.context_ids + question)],
            max_new_tokens=ANSWER_TOKENS,
            policy=policy,
            stop_tokens=stop,
            policy_params=params,
            cache=cache,
        )
        return out.tokens[0]

    _, cold = _timed(lambda: one(document.questions[0]))
    answers, warm = _timed(lambda: [one(q) for q in document.questions])
    return answers, warm, cold


def _bound_bytes(session, document, out) -> int:
    """One compressed context + the questions' and answers' tokens, at the pool's bytes per
    token and head."""
    kv = session.kv
    per_token = kv.pool.page_bytes // kv.pool.page_size
    heads = kv.num_layers * kv.page_table.shape[-2]
    rows = sum(len(q) for q in document.questions) + int(out.answers.num_tokens.sum())
    return session.memory_bytes() + rows * per_token * heads


def cache_config(storage: str) -> jaxkv.CacheConfig:
    """The cache of a `--storages` entry: "model", "int8" or "int8:F"."""
    kind, _, window = storage.partition(":")
    if kind == "int8" and window.isdigit():
        return jaxkv.CacheConfig(storage="int8", full_precision_window=int(window))
    if kind in ("model", "int8") and not window:
        return jaxkv.CacheConfig(storage=kind)
    raise ValueError(f"--storages {storage}: give model, int8 or int8:F (F an integer >= 1)")


def cache_config_arg(storage: str) -> str:
    """argparse's check of a `--storages` entry (kept as written, for the report)."""
    try:
        cache_config(storage)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return storage


def run(
    model, tokenizer, policy, length: int, questions: int, storage: str = "model", params=None
) -> dict:
    document = build_document(tokenizer, length, questions)
    cache = cache_config(storage)
    stop = list(model.config.eos_token_ids)
    questions_ids = [list(q) for q in document.questions]

    def ask():
        return jaxkv.ask(
            model,
            list(document.context_ids),
            questions_ids,
            policy,
            max_new_tokens=ANSWER_TOKENS,
            stop_tokens=stop,
            policy_params=params,
            cache=cache,
        )

    _, ask_cold = _timed(ask)
    out, ask_warm = _timed(ask)
    separate, separate_warm, separate_cold = _separate(model, document, policy, stop, params, cache)
    session = jaxkv.prefill(
        model, list(document.context_ids), policy, policy_params=params, cache=cache
    )
    alone = [
        jaxkv.decode(session.extend(q), ANSWER_TOKENS, stop_tokens=stop).tokens[0]
        for q in questions_ids
    ]
    shared_exact = [
        score(tokenizer, row, a)[0]
        for row, a in zip(out.answers.tokens, document.answers, strict=True)
    ]
    separate_exact = [
        score(tokenizer, row, a)[0] for row, a in zip(separate, document.answers, strict=True)
    ]
    bound = _bound_bytes(session, document, out)
    return {
        "context_tokens": len(document.context_ids),
        "questions": questions,
        "question_tokens": [len(q) for q in questions_ids],
        "kv_bytes_ask": out.total_bytes,
        "kv_bytes_context": session.memory_bytes(),
        "kv_bytes_shared_context": out.shared_bytes,
        "kv_bytes_per_row": [int(b) for b in out.row_bytes],
        "kv_bytes_bound": bound,
        "ask_over_bound": out.total_bytes / bound,
        "kv_bytes_one_copy_per_question": out.separate_bytes,
        "ask_over_one_copy_per_question": out.total_bytes / out.separate_bytes,
        "seconds_ask_warm": ask_warm,
        "seconds_generate_each_warm": separate_warm,
        "ask_over_generate_each_warm": ask_warm / separate_warm,
        "seconds_ask_cold": ask_cold,
        "seconds_first_generate_cold": separate_cold,
        "answers_ask": [tokenizer.decode(row) for row in out.answers.tokens],
        "answers_generate_each": [tokenizer.decode(row) for row in separate],
        "exact_ask": shared_exact,
        "exact_generate_each": separate_exact,
        "ask_equals_alone": [
            bool(np.array_equal(a, b)) for a, b in zip(out.answers.tokens, alone, strict=True)
        ],
    }


def markdown(report: dict) -> str:
    rows = [
        "| policy | storage | context | questions | compressed context KV MB | ask KV MB "
        "| ask KV bytes / bound | ask / one copy per question "
        "| ask / generate each (warm s) | exact: ask | exact: generate each "
        "| ask = asked alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        rows.append(
            f"| {row['policy']} | {row['storage']} | {row['context_tokens']} | {row['questions']} "
            f"| {row['kv_bytes_context'] / 1e6:.2f} | {row['kv_bytes_ask'] / 1e6:.2f} "
            f"| {row['ask_over_bound']:.3f} | {row['ask_over_one_copy_per_question']:.3f} "
            f"| {row['ask_over_generate_each_warm']:.3f} ({row['seconds_ask_warm']:.1f} / "
            f"{row['seconds_generate_each_warm']:.1f}) "
            f"| {sum(row['exact_ask'])}/{row['questions']} "
            f"| {sum(row['exact_generate_each'])}/{row['questions']} "
            f"| {sum(row['ask_equals_alone'])}/{row['questions']} |"
        )
    title = f"# Compress once, ask many ({report['model']})"
    return (
        f"{title}\n\n{harness.provenance_line(report['provenance'])}\n\n" + "\n".join(rows) + "\n"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench reuse", description=__doc__, formatter_class=harness.HelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help=harness.MODEL_HELP)
    parser.add_argument(
        "--policies", nargs="+", default=["kvzip:0.3"], help="policy specs, a row each"
    )
    parser.add_argument("--length", type=int, default=2048, help="context tokens (at most)")
    parser.add_argument(
        "--questions", type=int, default=8, help="questions over the context, a needle each"
    )
    parser.add_argument(
        "--storages",
        nargs="+",
        type=cache_config_arg,
        default=["model"],
        help="cache storages, a row each per policy: model, int8 or int8:F (the newest F "
        "tokens per head in the model dtype)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/reuse"),
        help="where the report goes: reuse.json and reuse.md in a folder per model",
    )
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    rows = []
    for spec in args.policies:
        policy = policies.from_spec(spec).for_tokenizer(tokenizer)
        for storage in args.storages:
            measured = run(model, tokenizer, policy, args.length, args.questions, storage)
            row = {"policy": spec, "storage": storage, **measured}
            harness.print_row(row)
            rows.append(row)
    report = {
        "provenance": harness.provenance("jaxkv bench reuse", argv),
        "model": args.model,
        "answer_tokens": ANSWER_TOKENS,
        "rows": rows,
    }
    out = args.out / Path(args.model).stem
    harness.save(out, "reuse", report, markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
