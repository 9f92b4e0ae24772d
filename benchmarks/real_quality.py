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
keeps part of a number); 95% Wilson intervals on exact match. KV bytes are what the cache holds
after compression, per sequence.

    jaxkv bench real_quality --policies full snapkv --budgets 0.3 --lengths 2048 \
        --samples 16 --out results/real-quality
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.quality import build_policy, greedy_continuation
from jaxkv.generation import compress_prompt
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.models import Tokenizer, render_chat
from jaxkv.policies import spec
from jaxkv.prose import prose

TASKS = ("needle", "multikey")
SETTINGS = ("aware", "agnostic")
MULTIKEY_KEYS = 6
DIGITS = 7
ANSWER_TOKENS = 10  # " " + 7 digits + "." + end of turn
EVAL_SEED = 20_000
_MARK = "\u2063CONTEXT\u2063"
# Keys are first names, no two alike: compound names that share a word (icy-otter, icy-meadow)
# are confused by the model with the full cache already, which would hide what policies lose.
_NAMES = (
    "Alice Bruno Clara Dmitri Elena Farid Greta Hiroshi Ingrid Javier Kofi Leila Marco Nadia "
    "Oscar Priya Quentin Rosa Stefan Tamara Ulrich Valeria Walter Yusuf"
).split()


@dataclasses.dataclass(frozen=True)
class TextEpisode:
    """context_ids: the chat prefix and the haystack; question_ids: the rest of the prompt (the
    question, end of turn, assistant header, answer prefix); answer: the digits asked for."""

    task: str
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answer: str
    depths: tuple[float, ...]


def _chat_halves(tokenizer: Tokenizer) -> tuple[str, str]:
    """The chat text before and after a user message's content (generation prompt included)."""
    text = render_chat(tokenizer, [{"role": "user", "content": _MARK}])
    before, after = text.split(_MARK)
    return before, after


def _sentences(seed: int) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", prose(60_000, seed=seed))


def _haystack_text(sentences: list[str], needles: list[str]) -> str:
    """Filler sentences joined by spaces, each needle a paragraph of its own (the full cache
    finds 12/16 multikey answers at 2K so, 10/16 with needles inline: what policies lose
    should show against a full cache that finds them)."""
    text = " ".join(sentences)
    for needle in needles:
        text = text.replace(needle, f"\n\n{needle}\n\n")
    return re.sub(r" *\n\n *", "\n\n", text).strip()


def build_episode(tokenizer: Tokenizer, task: str, length: int, index: int) -> TextEpisode:
    """Episode `index` of `task` with a prompt of at most `length` tokens (deterministic)."""
    rng = np.random.default_rng([EVAL_SEED, TASKS.index(task), length, index])
    keys = 1 if task == "needle" else MULTIKEY_KEYS
    names = [str(name) for name in rng.choice(_NAMES, keys, replace=False)]
    numbers = [str(rng.integers(10 ** (DIGITS - 1), 10**DIGITS)) for _ in names]
    asked = int(rng.integers(keys))
    if task == "needle":  # needles sweep the depths evenly over the episodes
        depths = [float((index * 0.618034) % 1.0)]
    else:
        depths = sorted(float(d) for d in rng.uniform(0, 1, keys))
    before, after = _chat_halves(tokenizer)
    question = (
        f"\n\nWhat is the special magic number for {names[asked]} mentioned in the text above?"
        f"{after}The special magic number for {names[asked]} is"
    )
    question_ids = tuple(tokenizer.encode(question, add_bos=False))
    prefix_ids = tokenizer.encode(before)
    room = length - len(prefix_ids) - len(question_ids) - 16 * keys
    sentences = _sentences(seed=int(rng.integers(1 << 30)))
    haystack, used = [], 0
    for sentence in sentences:
        cost = len(tokenizer.encode(" " + sentence, add_bos=False))
        if used + cost > room:
            break
        haystack.append(sentence)
        used += cost
    needles = [
        f"The special magic number for {n} is {v}." for n, v in zip(names, numbers, strict=True)
    ]
    for depth, needle in sorted(zip(depths, needles, strict=True), reverse=True):
        haystack.insert(round(depth * len(haystack)), needle)
    context_ids = prefix_ids + tokenizer.encode(_haystack_text(haystack, needles), add_bos=False)
    while len(context_ids) + len(question_ids) > length:  # sentences tokenize apart differently
        last_filler = max(i for i, s in enumerate(haystack) if s not in needles)
        del haystack[last_filler]
        context_ids = prefix_ids + tokenizer.encode(
            _haystack_text(haystack, needles), add_bos=False
        )
    order = sorted(range(keys), key=lambda k: depths[k])
    return TextEpisode(
        task=task,
        context_ids=tuple(context_ids),
        question_ids=question_ids,
        answer=numbers[asked],
        depths=(depths[order.index(asked)] if task == "multikey" else depths[0],),
    )


def score(tokenizer: Tokenizer, generated: np.ndarray, answer: str) -> tuple[bool, float]:
    """(exact match, share of correct leading digits) of a generated answer."""
    text = tokenizer.decode(generated)
    found = re.search(r"\d+", text)
    digits = found.group(0) if found else ""
    pairs = zip(digits, answer, strict=False)  # a wrong answer may have more or fewer digits
    leading = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    leading = min(len(digits), len(answer)) if leading is None else leading
    return digits == answer, leading / len(answer)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = (
        z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def run_cell(
    model, tokenizer, policy, episodes: list[TextEpisode], setting: str, policy_params=None
) -> dict:
    """Answers of one (policy, setting) over the episodes, batched: scores and bytes held."""
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
        generated = np.asarray(out.tokens)
        kv_bytes = float(out.memory_bytes[0]) / len(episodes)
    else:
        contexts = [list(e.context_ids) for e in episodes]
        extra = max(len(e.question_ids) for e in episodes) + ANSWER_TOKENS
        kv = compress_prompt(
            model, contexts, policy, reserve_tokens=extra, policy_params=policy_params
        )
        kv_bytes = kv.memory_bytes() / len(episodes)
        starts = np.array([len(c) for c in contexts])
        questions = [list(e.question_ids) for e in episodes]
        generated = greedy_continuation(model, kv, questions, starts, ANSWER_TOKENS)
    results = [score(tokenizer, row, e.answer) for row, e in zip(generated, episodes, strict=True)]
    exact = sum(r[0] for r in results)
    return {
        "exact": exact / len(episodes),
        "exact_interval": wilson_interval(exact, len(episodes)),
        "leading_digits": float(np.mean([r[1] for r in results])),
        "kv_bytes_per_sequence": kv_bytes,
        "samples": len(episodes),
    }


def _cells(names, budgets, params: dict[str, list[Path]]):
    """(policy name, budget or None, parameters path or None) of every run."""
    for name in names:
        sources = params.get(name) or [None]
        budget_values = budgets if spec.takes_budget(name) else [None]
        yield from ((name, b, source) for source in sources for b in budget_values)


def policy_label(name: str, source: Path | None) -> str:
    """A row's policy: the name, and the parameters' directory for a learned one."""
    if source is None:
        return name
    directory = source.parent if source.is_file() else source
    return f"{name}[{directory.name}]"


def markdown_table(rows: list[dict]) -> str:
    """One line per (policy, budget, length, setting): exact [interval] / leading digits."""
    full = {
        (r["length"], r["task"], r["setting"]): r["kv_bytes_per_sequence"]
        for r in rows
        if r["policy"] == "full"
    }
    lines = [
        "| policy | budget | context | setting | KV of full | needle exact [95% CI] | "
        "needle digits | multikey exact [95% CI] | multikey digits | samples |",
        "|" + " --- |" * 10,
    ]
    keys = sorted(
        {(r["policy"], r["budget"], r["length"], r["setting"]) for r in rows},
        key=lambda k: (k[2], k[3], k[0], -1 if k[1] is None else k[1]),
    )
    for policy, budget, length, setting in keys:
        cells = {
            r["task"]: r
            for r in rows
            if (r["policy"], r["budget"], r["length"], r["setting"])
            == (policy, budget, length, setting)
        }
        shares = [
            c["kv_bytes_per_sequence"] / full[(length, t, setting)]
            for t, c in cells.items()
            if (length, t, setting) in full
        ]
        share = f"{100 * np.mean(shares):.0f}%" if shares else "?"
        values = []
        for task in TASKS:
            cell = cells.get(task)
            if cell is None:
                values += ["", ""]
                continue
            low, high = cell["exact_interval"]
            values += [
                f"{cell['exact']:.2f} [{low:.2f}, {high:.2f}]",
                f"{cell['leading_digits']:.2f}",
            ]
        samples = "/".join(sorted({str(c["samples"]) for c in cells.values()}))
        budget_text = "auto" if budget is None else f"{budget:g}"
        lines.append(
            f"| {policy} | {budget_text} | {length} | {setting} | {share} | "
            + " | ".join(values)
            + f" | {samples} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Exact match against the share of the full cache's bytes, a panel per task x setting."""
    plt = harness.pyplot()

    panels = sorted({(r["task"], r["setting"], r["length"]) for r in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for axis, (task, setting, length) in zip(axes.flat, panels, strict=True):
        cell_rows = [
            r for r in rows if (r["task"], r["setting"], r["length"]) == (task, setting, length)
        ]
        full = next((r["kv_bytes_per_sequence"] for r in cell_rows if r["policy"] == "full"), None)
        for name in sorted({r["policy"] for r in cell_rows}):
            points = sorted(
                (r["kv_bytes_per_sequence"] / (full or 1), r["exact"])
                for r in cell_rows
                if r["policy"] == name
            )
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, marker="o", label=name)
        axis.set_title(f"{task}, {setting}, {length} tokens")
        axis.set_xlabel("KV bytes held / full cache's" if full else "KV bytes held")
        axis.set_ylabel("exact match")
        axis.set_ylim(-0.05, 1.05)
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(report_path: Path) -> dict:
    """quality.md and quality.png beside a saved report, from its rows."""
    rows = json.loads(report_path.read_text())["rows"]
    table = markdown_table(rows)
    (report_path.parent / "quality.md").write_text(table)
    plot(rows, report_path.parent / "quality.png")
    print(table)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench real_quality", description=__doc__)
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a fetched model's name, a .gguf file or a checkpoint directory",
    )
    parser.add_argument("--policies", nargs="+", default=["full", "streaming_llm", "snapkv"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument(
        "--params",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="saved parameters of a learned policy (jaxkv train), e.g. "
        "wgkv=assets/wgkv-gates/smollm2-135m-instruct/lambda-0.08",
    )
    parser.add_argument("--out", type=Path, default=Path("results/real-quality"))
    parser.add_argument(
        "--render",
        type=Path,
        help="write the table and plot of a saved quality.json (this benchmark's or "
        "kvpress_reference's) beside it, and run nothing",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    known = policies.registered()
    params = spec.parse_params(args.params)
    for name in args.policies:
        if name not in known:
            raise ValueError(f"--policies {name}: registered policies are {known}")
        if policies.policy_class(name).needs_params and name not in params:
            raise ValueError(
                f"--policies {name}: give its trained parameters, --params {name}=PATH"
            )
    for budget in args.budgets:
        if not 0 < budget <= 1:
            raise ValueError(f"--budgets {budget}: a ratio of the prompt in (0, 1]")
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples} must be >= 1")
    model, tokenizer = load_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "quality.json"
    previous = json.loads(report_path.read_text()) if report_path.exists() else {}
    rows = previous.get("rows", [])
    commands = [*previous.get("commands", []), "jaxkv bench real_quality " + " ".join(argv)]
    done = {(r["policy"], r["budget"], r["length"], r["task"], r["setting"]) for r in rows}
    episodes = {
        (task, length): [build_episode(tokenizer, task, length, i) for i in range(args.samples)]
        for task in args.tasks
        for length in args.lengths
    }
    cells = [
        (name, budget, source, length, task, setting)
        for name, budget, source in _cells(args.policies, args.budgets, params)
        for length in args.lengths
        for task in args.tasks
        for setting in args.settings
        if (policy_label(name, source), budget, length, task, setting) not in done
    ]
    loaded = {}
    for name, budget, source, length, task, setting in tqdm(
        cells, desc="real quality", unit="cell"
    ):
        policy = build_policy(name, budget).for_tokenizer(tokenizer)
        if source is not None and source not in loaded:
            loaded[source] = policy.load_params(source, model.config)
        result = run_cell(
            model, tokenizer, policy, episodes[(task, length)], setting, loaded.get(source)
        )
        label = policy_label(name, source)
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
            "commands": commands,
            "model": args.model,
            "file_sha256": model_file_sha256(args.model),
            "jax": jax.__version__,
            "rows": rows,
        }
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown_table(rows)
    (args.out / "quality.md").write_text(table)
    plot(rows, args.out / "quality.png")
    print(table)
    return {"rows": rows}


if __name__ == "__main__":
    main()
