"""Quality of every registered policy on the reference model, against the KV memory it holds.

Tasks (episodes from `jaxkv.tasks` on the held-out corpus split, seeds disjoint from training):
  needle, multikey, multivalue, vartrack  `generate` (greedy, the policy's prefill compression
      and decode hooks), scored by exact match of the answer;
  multiquestion  the context alone is compressed once, then several multikey questions are asked
      of that same cache (copies of it), so the cache must serve questions it never saw;
  bpb  bits per byte of a held-out continuation read over the compressed context.
Multiquestion and bpb continue from `compress_prompt`'s state with full-cache decoding (the
policy's decode-time hooks do not run there).

Policies with a `budget` run at every budget of the sweep (ratios of the prompt); the others
(full, gvote, confkv) choose their own and run once. Memory is what the cache actually holds
after prefill and compression (`memory_bytes`), per sequence, not the nominal ratio.

    jaxkv bench quality --out results/quality                 # the full sweep (hours on a CPU)
    jaxkv bench quality --fast --out /tmp/quality             # the harness in a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv import bundled, policies, tasks
from jaxkv.benchmarks import harness
from jaxkv.forward import forward_cached
from jaxkv.generation import compress_prompt
from jaxkv.models import Model, load_hf_checkpoint
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.policies import spec
from jaxkv.train import corpus as corpus_lib

REFERENCE_MODEL = bundled.REFERENCE_MODEL
BOS, EOS, PAD = 256, 257, 258
QA_TASKS = ("needle", "multikey", "multivalue", "vartrack")
TASKS = (*QA_TASKS, "multiquestion", "bpb")
EVAL_SEED = 10_000  # training draws from seeds below this, on the train split
PAGE_SIZE = 16
QUESTIONS = 3
CONTINUATION_BYTES = 256


@dataclasses.dataclass(frozen=True)
class Sweep:
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    lengths: tuple[int, ...]
    samples: int
    tasks: tuple[str, ...] = TASKS


def _runs_by_default(name: str) -> bool:
    """A policy without parameters, or whose parameters ship for the reference model; the
    others (calibrated heads) run when given theirs."""
    policy = policies.get(name)
    return not policy.needs_params or policy.bundled_params_path() is not None


FULL = Sweep(
    policies=tuple(n for n in policies.registered() if _runs_by_default(n)),
    budgets=(0.1, 0.2, 0.3, 0.5, 1.0),
    lengths=(2048, 4096),
    samples=16,
)
FAST = Sweep(
    policies=("full", "sliding_window", "streaming_llm"),
    budgets=(0.5,),
    lengths=(512,),
    samples=2,
)


def check_sweep(sweep: Sweep, policy_params: dict | None = None) -> None:
    """Names the bad value before anything runs."""
    known = policies.registered()
    for name in sweep.policies:
        if name not in known:
            raise ValueError(f"policy={name!r}: registered policies are {known}")
        policy = policies.get(name)
        has_params = name in (policy_params or {}) or policy.bundled_params_path() is not None
        if policy.needs_params and not has_params:
            raise ValueError(f"policy={name!r} needs policy_params: --params {name}=PATH")
    for budget in sweep.budgets:
        if not 0 < budget <= 1:
            raise ValueError(f"budget={budget}: a ratio of the prompt in (0, 1]")
    for task in sweep.tasks:
        if task not in TASKS:
            raise ValueError(f"task={task!r}: allowed are {TASKS}")
    for length in sweep.lengths:
        if length < 512:
            raise ValueError(f"length={length}: contexts must hold at least 512 bytes")
    if sweep.samples < 1:
        raise ValueError(f"samples={sweep.samples} must be >= 1")


def policy_runs(sweep: Sweep):
    """(policy name, budget or None) pairs."""
    for name in sweep.policies:
        if spec.takes_budget(name):
            yield from ((name, budget) for budget in sweep.budgets)
        else:
            yield name, None


def build_policy(name: str, budget: float | None):
    """Policy `name` at a budget ratio (None: its defaults; `policies.get` maps the budget to
    KVzip's `ratio=`)."""
    return policies.get(name) if budget is None else policies.get(name, budget=budget)


def _rng(task: str, length: int) -> np.random.Generator:
    return np.random.default_rng([EVAL_SEED, TASKS.index(task), length])


def qa_episodes(task: str, corpus, length: int, samples: int) -> list[tasks.Episode]:
    """Needles sweep the depths evenly; the other kinds draw theirs."""
    rng = _rng(task, length)
    prompt_length = length - 1
    if task == "needle":
        depths = np.linspace(0.0, 1.0, samples)
        return [tasks.needle(corpus, rng, prompt_length, depth=float(d)) for d in depths]
    return [tasks.make_episode(task, corpus, rng, prompt_length) for _ in range(samples)]


def _num_pages(model: Model, batch: int, tokens: int) -> int:
    cfg = model.config
    return cfg.num_layers * batch * cfg.num_kv_heads * -(-tokens // PAGE_SIZE)


def run_qa(model, policy, episodes, policy_params=None) -> dict:
    prompts = [[BOS, *episode.prompt] for episode in episodes]
    answer_bytes = max(len(episode.answer) for episode in episodes)
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=answer_bytes,
        policy=policy,
        stop_tokens=[EOS],
        pad_id=PAD,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        policy_params=policy_params,
    )
    correct = [
        bytes(int(t) for t in out.tokens[i, : len(e.answer)] if t < 256) == e.answer
        for i, e in enumerate(episodes)
    ]
    # Tokens each sequence holds at the end, averaged over layers and KV heads: budgets that
    # adapt per request (GVote, Conf-KV) show their spread here.
    held = np.asarray(out.state.lengths).mean(axis=(0, 2))
    if out.state.ring is not None:  # WG-KV's local ring holds the last W tokens on top
        held = held + np.minimum(np.asarray(out.state.ring.count), out.state.ring.window).mean(0)
    return {
        "accuracy": float(np.mean(correct)),
        "kv_bytes_per_sequence": float(out.memory_bytes[0]) / len(episodes),
        "kv_tokens_held": [round(float(t), 1) for t in held],
    }


@functools.partial(jax.jit, static_argnames="policy")
def _continue(model, kv, tokens, positions, policy):
    """Logits f32 [B, C, V] of a chunk read over (and appended to) the state, and the state."""
    hidden, kv, _ = forward_cached(model, tokens, positions, kv, policy=policy)
    return logits_from_hidden(model.params, model.config, hidden), kv


def _right_aligned(rows: list[list[int]], starts: np.ndarray):
    """Chunk tokens [B, C] and positions (-1 padding) of rows continuing at `starts`."""
    width = max(map(len, rows))
    tokens = np.full((len(rows), width), PAD, np.int32)
    positions = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
        positions[i, : len(row)] = starts[i] + np.arange(len(row))
    return jnp.asarray(tokens), jnp.asarray(positions)


def greedy_continuation(model, kv, question_rows, starts, steps: int) -> np.ndarray:
    """Reads the questions over `kv`, then greedy-decodes `steps` tokens: int [B, steps]."""
    full = policies.FullCache().static()
    tokens, positions = _right_aligned(question_rows, starts)
    logits, kv = _continue(model, kv, tokens, positions, full)
    last = np.array([len(row) - 1 for row in question_rows])
    next_token = np.asarray(jnp.argmax(logits, -1))[np.arange(len(last)), last]
    position = starts + last + 1
    generated = [next_token]
    for _ in range(steps - 1):
        logits, kv = _continue(
            model, kv, jnp.asarray(next_token[:, None]), jnp.asarray(position[:, None]), full
        )
        next_token = np.asarray(jnp.argmax(logits[:, 0], -1))
        position = position + 1
        generated.append(next_token)
    return np.stack(generated, axis=1)


def _compressed_context(
    model, policy, contexts: list[bytes], extra_tokens: int, policy_params=None
):
    prompts = [[BOS, *context] for context in contexts]
    longest = max(map(len, prompts)) + extra_tokens
    kv = compress_prompt(
        model,
        prompts,
        policy,
        cache=jaxkv.CacheConfig(
            page_size=PAGE_SIZE, num_pages=_num_pages(model, len(prompts), longest)
        ),
        reserve_tokens=extra_tokens,
        policy_params=policy_params,
    )
    starts = np.array([len(prompt) for prompt in prompts])
    kv_bytes = kv.memory_bytes() / len(prompts)
    return kv, starts, kv_bytes


def run_multiquestion(model, policy, corpus, length: int, samples: int, policy_params=None) -> dict:
    """Several multikey facts per context; the compressed context answers each question."""
    rng = _rng("multiquestion", length)
    contexts, questions, answers = [], [], []
    for _ in range(samples):
        episode = tasks.needle(corpus, rng, length - 1, num_keys=QUESTIONS)
        asked = episode.prompt.rindex(b"\n# What is the special magic number")
        contexts.append(episode.prompt[:asked])
        names = [
            line.split(b" for ")[1].split(b" is ")
            for line in episode.prompt[:asked].split(b"\n")
            if line.startswith(b"# The special magic number for ")
        ]
        questions.append(
            [
                b"\n# What is the special magic number for %s? "
                b"The special magic number for %s is " % (name, name)
                for name, _ in names
            ]
        )
        answers.append([value.rstrip(b".") + b".\n" for _, value in names])
    steps = max(len(a) for row in answers for a in row)
    extra = max(len(q) for row in questions for q in row) + steps
    kv, starts, kv_bytes = _compressed_context(model, policy, contexts, extra, policy_params)
    correct = []
    for index in range(QUESTIONS):
        rows = [list(row[index]) for row in questions]
        generated = greedy_continuation(model, kv, rows, starts, steps)
        for i, row in enumerate(answers):
            correct.append(bytes(int(t) for t in generated[i, : len(row[index])]) == row[index])
    return {"accuracy": float(np.mean(correct)), "kv_bytes_per_sequence": kv_bytes}


def run_bpb(model, policy, corpus, length: int, samples: int, policy_params=None) -> dict:
    """Bits per byte of the next CONTINUATION_BYTES bytes after a compressed context."""
    rng = _rng("bpb", length)
    texts = [corpus.text(rng, length - 1 + CONTINUATION_BYTES) for _ in range(samples)]
    contexts = [text[: length - 1] for text in texts]
    continuations = [list(text[length - 1 :]) for text in texts]
    kv, starts, kv_bytes = _compressed_context(
        model, policy, contexts, CONTINUATION_BYTES, policy_params
    )
    full = policies.FullCache().static()
    tokens, positions = _right_aligned(continuations, starts)
    logits, _ = _continue(model, kv, tokens[:, :-1], positions[:, :-1], full)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    return {
        "bits_per_byte": float(jnp.mean(nll)) / math.log(2),
        "kv_bytes_per_sequence": kv_bytes,
    }


def run_task(model, policy, corpus, task: str, length: int, samples: int, policy_params=None):
    """One task's result dict for one policy (and its parameters, if it takes any)."""
    if task in QA_TASKS:
        episodes = qa_episodes(task, corpus, length, samples)
        return run_qa(model, policy, episodes, policy_params)
    if task == "multiquestion":
        return run_multiquestion(model, policy, corpus, length, samples, policy_params)
    return run_bpb(model, policy, corpus, length, samples, policy_params)


def run_sweep(model, sweep: Sweep, corpus, *, log=print, policy_params=None) -> list[dict]:
    """`policy_params` maps a policy name to its parameters (e.g. {"wgkv": gates})."""
    policy_params = dict(policy_params or {})
    check_sweep(sweep, policy_params)
    rows = []
    cells = [
        (name, budget, length, task)
        for name, budget in policy_runs(sweep)
        for length in sweep.lengths
        for task in sweep.tasks
    ]
    for name in sweep.policies:
        policy = policies.get(name)
        path = policy.bundled_params_path()
        if name not in policy_params and path is not None:
            policy_params[name] = policy.load_params(path, model.config)
    for name, budget, length, task in tqdm(cells, desc="quality", unit="cell"):
        policy = build_policy(name, budget)
        params = policy_params.get(name)
        result = run_task(model, policy, corpus, task, length, sweep.samples, params)
        row = {"policy": name, "budget": budget, "length": length, "task": task}
        rows.append({**row, "samples": sweep.samples, **result})
        log(json.dumps(rows[-1]))
    return rows


def markdown_table(rows: list[dict]) -> str:
    """One line per (policy, budget, length): each task's accuracy (bpb for bpb), KV KiB and
    the number of episodes (texts for bpb) behind each cell."""
    tasks_seen = [t for t in TASKS if any(r["task"] == t for r in rows)]
    keys = sorted(
        {(r["policy"], r["budget"], r["length"]) for r in rows},
        key=lambda k: (k[2], k[0], -1 if k[1] is None else k[1]),
    )
    header = "| policy | budget | context | KV KiB/seq | " + " | ".join(tasks_seen) + " | samples |"
    lines = [header, "|" + " --- |" * (5 + len(tasks_seen))]
    for policy, budget, length in keys:
        cells = {
            r["task"]: r
            for r in rows
            if (r["policy"], r["budget"], r["length"]) == (policy, budget, length)
        }
        kib = np.mean([c["kv_bytes_per_sequence"] for c in cells.values()]) / 1024
        values = []
        for task in tasks_seen:
            cell = cells.get(task)
            if cell is None:
                values.append("")
            elif task == "bpb":
                values.append(f"{cell['bits_per_byte']:.3f}")
            else:
                values.append(f"{cell['accuracy']:.2f}")
        budget_text = "auto" if budget is None else f"{budget:g}"
        samples = "/".join(sorted({str(c["samples"]) for c in cells.values()}))
        lines.append(
            f"| {policy} | {budget_text} | {length} | {kib:.0f} | "
            + " | ".join(values)
            + f" | {samples} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy (bits per byte for bpb) against KV KiB held, one panel per (task, length)."""
    plt = harness.pyplot()

    panels = sorted(
        {(r["task"], r["length"]) for r in rows}, key=lambda p: (TASKS.index(p[0]), p[1])
    )
    columns = min(3, len(panels))
    figure, axes = plt.subplots(
        -(-len(panels) // columns),
        columns,
        figsize=(5 * columns, 3.6 * -(-len(panels) // columns)),
        squeeze=False,
    )
    for axis, (task, length) in zip(axes.flat, panels, strict=False):
        metric = "bits_per_byte" if task == "bpb" else "accuracy"
        for name in sorted({r["policy"] for r in rows}):
            points = sorted(
                (r["kv_bytes_per_sequence"] / 1024, r[metric])
                for r in rows
                if r["task"] == task and r["length"] == length and r["policy"] == name
            )
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", label=name)
        axis.set_title(f"{task}, context {length}")
        axis.set_xlabel("KV KiB held per sequence")
        axis.set_ylabel(metric.replace("_", " "))
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(report_path: Path) -> dict:
    """Rewrites the markdown table and plot of a saved report (e.g. after merging runs)."""
    report = json.loads(report_path.read_text())
    table = markdown_table(report["rows"])
    report_path.with_suffix(".md").write_text(table)
    plot(report["rows"], report_path.with_suffix(".png"))
    print(table)
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench quality", description=__doc__)
    parser.add_argument("--model", type=Path, default=REFERENCE_MODEL)
    parser.add_argument("--fast", action="store_true", help="the CI sweep: 3 policies, 2 samples")
    parser.add_argument("--policies", nargs="*", help="policy names (default: every registered)")
    parser.add_argument("--budgets", type=float, nargs="*", help="ratios of the prompt in (0, 1]")
    parser.add_argument("--lengths", type=int, nargs="*", help="context lengths in bytes")
    parser.add_argument("--tasks", nargs="*", help=f"a subset of {TASKS}")
    parser.add_argument("--samples", type=int)
    parser.add_argument(
        "--params",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="saved parameters of a learned policy (default: those jaxkv ships for the "
        "reference model, e.g. wgkv=assets/wgkv-gates/lambda-0.08)",
    )
    parser.add_argument("--out", type=Path, default=Path("quality"))
    parser.add_argument(
        "--render",
        type=Path,
        help="a quality.json: rewrite its table and plot beside it, run nothing",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    sweep = FAST if args.fast else FULL
    overrides = {
        "policies": tuple(args.policies) if args.policies else None,
        "budgets": tuple(args.budgets) if args.budgets else None,
        "lengths": tuple(args.lengths) if args.lengths else None,
        "tasks": tuple(args.tasks) if args.tasks else None,
        "samples": args.samples,
    }
    sweep = dataclasses.replace(sweep, **{k: v for k, v in overrides.items() if v is not None})
    paths = {name: found[-1] for name, found in spec.parse_params(args.params).items()}
    check_sweep(sweep, paths)
    model = load_hf_checkpoint(args.model, dtype="float32")
    params = {
        name: policies.get(name).load_params(path, model.config) for name, path in paths.items()
    }
    heldout = corpus_lib.load_corpus("heldout")
    rows = run_sweep(model, sweep, heldout, policy_params=params)
    report = {
        **harness.provenance("jaxkv bench quality", sys.argv[1:] if argv is None else argv),
        "model": str(args.model),
        "params": {
            name: str(paths.get(name, policies.get(name).bundled_params_path()))
            for name in sweep.policies
            if policies.get(name).needs_params
        },
        "sweep": dataclasses.asdict(sweep),
        "rows": rows,
    }
    harness.save(args.out, "quality", report)
    return render(args.out / "quality.json")


if __name__ == "__main__":
    main()
