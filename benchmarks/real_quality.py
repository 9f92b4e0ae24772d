"""Retrieval quality of every policy on a real pretrained model (SmolLM2-135M-Instruct, GGUF).

Episodes: natural prose from Python's own documentation (`jaxkv.prose`) as the haystack, with
7-digit "special magic number" needles at chosen depths, each a paragraph of its own; `needle`
hides one and asks for it, `multikey` hides six under different names and asks for one. The
prompt is the model's chat format: the haystack and then the question in one user turn, then
the assistant header and the answer prefix "The special magic number for NAME is".
Every policy sees the same token ids.

Two settings:
  aware     the question is part of the compressed prompt (`generate` with the policy);
  agnostic  the context alone (up to the end of the haystack) is compressed by `compress_prompt`,
            then the question is read over the compressed cache and the answer decoded with the
            full-cache rule (kvpress's setting: the cache must serve a question it never saw).
Scores: exact match of the 7 digits, and the share of correct leading digits (eviction often
keeps part of a number); 95% Wilson intervals on exact match; each episode's exact match
(`episode_exact`), so that a policy is compared with the full cache episode by episode
(`quality-paired.md`). KV bytes are what the cache holds after compression, per sequence.

    jaxkv bench real_quality --policies full snapkv --budgets 0.3 --lengths 2048 \
        --samples 16 --out results/real-quality/needles-2k

A policy entry may set fields other than the budget, `wgkv:tau=0.3` (its row `wgkv[DIR]:tau=0.3`
with `--params wgkv=DIR`): a learned gate's threshold moves it along its accuracy-vs-bytes curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness, real_quality_report
from jaxkv.benchmarks.needles import (
    ANSWER_TOKENS,
    SETTINGS,
    TASKS,
    TextEpisode,
    build_episode,
    score,
)
from jaxkv.model_sources import load_model, model_file_sha256, shipped_name
from jaxkv.policies import spec


def _answers(model, policy, episodes: list[TextEpisode], setting: str, policy_params):
    """The answer tokens [B, ANSWER_TOKENS] of one batch of episodes and the KV bytes the
    batch's cache holds after compression."""
    stop = list(model.config.eos_token_ids)
    if setting == "aware":
        prompts = [list(e.context_ids + e.question_ids) for e in episodes]
        out = jaxkv.generate(
            model,
            prompts,
            max_new_tokens=ANSWER_TOKENS,
            policy=policy,
            stop_tokens=stop,
            policy_params=policy_params,
        )
        return np.asarray(out.tokens), float(out.memory_bytes[0])
    contexts = [list(e.context_ids) for e in episodes]
    extra = max(len(e.question_ids) for e in episodes) + ANSWER_TOKENS
    session = jaxkv.prefill(
        model, contexts, policy, reserve_tokens=extra, policy_params=policy_params
    )
    held = session.memory_bytes()
    questions = [list(e.question_ids) for e in episodes]
    out = jaxkv.decode(session.extend(questions), ANSWER_TOKENS, stop_tokens=stop)
    return np.asarray(out.tokens), held


def run_cell(
    model,
    tokenizer,
    policy,
    episodes: list[TextEpisode],
    setting: str,
    policy_params=None,
    batch_size: int | None = None,
) -> dict:
    """Answers of one (policy, setting) over the episodes, `batch_size` at a time (None: all in
    one batch): scores and bytes held."""
    batch_size = batch_size or len(episodes)
    generated, kv_bytes = [], 0.0
    for start in range(0, len(episodes), batch_size):
        tokens, held = _answers(
            model, policy, episodes[start : start + batch_size], setting, policy_params
        )
        generated.extend(tokens)
        kv_bytes += held
    results = [score(tokenizer, row, e.answer) for row, e in zip(generated, episodes, strict=True)]
    exact = sum(r[0] for r in results)
    return {
        "exact": exact / len(episodes),
        "exact_interval": harness.wilson_interval(exact, len(episodes)),
        "leading_digits": float(np.mean([r[1] for r in results])),
        "kv_bytes_per_sequence": kv_bytes / len(episodes),
        "samples": len(episodes),
        "episode_exact": [bool(r[0]) for r in results],
    }


def parse_policy_entry(entry: str) -> tuple[str, dict]:
    """`NAME[:KEY=VALUE...]` of `--policies`: the name and the policy's keyword arguments from
    the KEY=VALUE parts (a budget comes from `--budgets`, never from here)."""
    name, *pairs = entry.split(":")
    if name not in policies.registered():
        raise ValueError(f"--policies {entry}: registered policies are {policies.registered()}")
    for pair in pairs:
        key = pair.partition("=")[0].strip()
        if "=" not in pair or key in ("budget", "ratio"):
            raise ValueError(
                f"--policies {entry}: after the name give KEY=VALUE options (e.g. wgkv:tau=0.3); "
                "budgets come from --budgets"
            )
    kwargs = spec.policy_kwargs(name, pairs, None, pair_option=f"--policies {entry}, option")
    return name, kwargs


def _cells(parsed: dict[str, tuple[str, dict]], budgets, params: dict[str, list[Path]]):
    """(policy entry, budget or None, parameters path or None) of every run; `parsed` maps each
    entry to `parse_policy_entry`'s (name, options)."""
    for entry, (name, _) in parsed.items():
        sources = params.get(name) or [None]
        budget_values = budgets if spec.takes_budget(name) else [None]
        yield from ((entry, b, source) for source in sources for b in budget_values)


def policy_label(entry: str, source: Path | None) -> str:
    """A row's policy: the name, the parameters' directory for a learned one, then the
    entry's options, e.g. `wgkv[lambda-0.08]:tau=0.3`."""
    name, _, options = entry.partition(":")
    if source is not None:
        directory = source.parent if source.is_file() else source
        name = f"{name}[{directory.name}]"
    return f"{name}:{options}" if options else name


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench real_quality", description=__doc__)
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a fetched model's name, a .gguf file or a checkpoint directory",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["full", "streaming_llm", "snapkv"],
        metavar="NAME[:KEY=VALUE...]",
        help="registered policies, each with options that set its fields (wgkv:tau=0.3, "
        "local_attention:window=128); a row's policy is the entry, learned parameters' "
        "directory after the name",
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument(
        "--batch",
        type=int,
        help="episodes per batch (default: a cell's episodes in one batch); fewer hold less "
        "memory, each episode's answer is its own",
    )
    parser.add_argument(
        "--params",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="saved parameters of a learned policy (jaxkv train), e.g. "
        "wgkv=assets/wgkv-gates/smollm2-135m-instruct/lambda-0.08 (default: the ones jaxkv "
        "ships for --model, jaxkv.bundled.SHIPPED_PARAMS)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/real-quality/needles-2k"))
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="run the asked cells again even where OUT/quality.json holds them (their rows are "
        "replaced); without it such cells are skipped, and the run says how many",
    )
    parser.add_argument(
        "--render",
        type=Path,
        help="write the table and plot of a saved quality.json (this benchmark's or "
        "kvpress_reference's) beside it, and run nothing",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="with --render: also write agreement.md beside it, the cells it shares with this "
        "report (jaxkv's results/real-quality/needles-2k/quality.json) side by side, in episodes",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.against is not None and args.render is None:
        raise ValueError("--against compares a report given with --render: give --render PATH")
    if args.render is not None:
        return real_quality_report.render(args.render, args.against)
    params = spec.parse_params(args.params)
    parsed = {entry: parse_policy_entry(entry) for entry in args.policies}
    for entry, (name, _) in parsed.items():
        part = policies.get(name).params
        shipped = part.shipped_path(shipped_name(args.model)) if part else None
        if name not in params and shipped is not None:
            params[name] = [shipped]
        if part is not None and name not in params:
            raise ValueError(
                f"--policies {entry}: jaxkv ships no trained parameters of {name} for --model "
                f"{args.model}; give them, --params {name}=PATH"
            )

    for budget in args.budgets:
        if not 0 < budget <= 1:
            raise ValueError(f"--budgets {budget}: a ratio of the prompt in (0, 1]")
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples} must be >= 1")
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch {args.batch} must be >= 1 (or left out: one batch a cell)")
    model, tokenizer = load_model(args.model)
    # Every named input is read before any cell is skipped or run: a missing gate is an error
    # even when the report already holds its cells.
    loaded = {
        source: harness.build_policy(
            name, args.budgets[0] if spec.takes_budget(name) else None, **options
        ).params.load(source, model.config)
        for name, options in parsed.values()
        for source in params.get(name, [])
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "quality.json"
    previous = json.loads(report_path.read_text()) if report_path.exists() else {}
    rows = previous.get("rows", [])
    commands = [*previous.get("commands", []), "jaxkv bench real_quality " + " ".join(argv)]
    done = {real_quality_report.cell_key(r) for r in rows}
    episodes = {
        (task, length): [build_episode(tokenizer, task, length, i) for i in range(args.samples)]
        for task in args.tasks
        for length in args.lengths
    }
    asked = [
        (entry, budget, source, length, task, setting)
        for entry, budget, source in _cells(parsed, args.budgets, params)
        for length in args.lengths
        for task in args.tasks
        for setting in args.settings
    ]
    keys = {cell: (policy_label(cell[0], cell[2]), *cell[1:2], *cell[3:]) for cell in asked}
    if args.recompute:
        rows = [row for row in rows if real_quality_report.cell_key(row) not in set(keys.values())]
        done = {real_quality_report.cell_key(r) for r in rows}
    cells = [cell for cell in asked if keys[cell] not in done]
    if len(cells) < len(asked):
        print(
            f"{len(asked) - len(cells)} of {len(asked)} cells are already in {report_path}: "
            "skipped (--recompute runs them again)",
            flush=True,
        )
    for entry, budget, source, length, task, setting in tqdm(
        cells, desc="real quality", unit="cell"
    ):
        name, options = parsed[entry]
        policy = harness.build_policy(name, budget, **options).for_tokenizer(tokenizer)
        result = run_cell(
            model,
            tokenizer,
            policy,
            episodes[(task, length)],
            setting,
            loaded.get(source),
            batch_size=args.batch,
        )
        label = policy_label(entry, source)
        row = {
            "policy": label,
            "budget": budget,
            "length": length,
            "task": task,
            "setting": setting,
        }
        if source is not None:
            row["params"] = str(source)
        rows.append({**row, **result})
        print(json.dumps(rows[-1]), flush=True)
        report = {
            "provenance": harness.provenance("jaxkv bench real_quality", argv),
            "commands": commands,
            "model": args.model,
            "file_sha256": model_file_sha256(args.model),
            "jax": jax.__version__,
            "rows": rows,
        }
        harness.save(args.out, "quality", report)  # after each row: a cut run resumes
    print(real_quality_report.write(rows, args.out))
    return {"rows": rows}


if __name__ == "__main__":
    main()
