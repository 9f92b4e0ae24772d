"""WG-KV on the reference model: against static admission at equal memory, and with Quest.

For every gates file (one per lambda of the distillation), on the quality benchmark's tasks
(`benchmarks/byte_tasks.py`):
  wgkv             WGKV(tau, window) with those gates; its memory M per sequence is measured
                   (ring + admitted pages, what the cache really holds after prefill).
  local_attention  sinks + sliding window, the window chosen so the ring holds M bytes.
  duo_attention    the same ring as WG-KV; whole heads (the highest
                   `long_range_attention_mass` on held-out calibration texts) admit every
                   token: the head counts just below and just above WG-KV's memory.
  quest / wgkv+quest  at one read budget R tokens per head: Quest alone reads R, WG-KV + Quest
                   reads its W ring tokens plus R - W of global pages chosen by Quest.
The full cache is the reference row. Memory is measured per row, never assumed.

    python -m jaxkv.benchmarks.wgkv_quality --gates assets/wgkv-gates/*/gates.safetensors --out out/
    python -m jaxkv.benchmarks.wgkv_quality --fast --out /tmp/wgkv  # random gates, the harness only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from jaxkv import bundled, policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.byte_tasks import BOS, QA_TASKS, run_task
from jaxkv.cache import LocalRing
from jaxkv.gates.wgkv import init_write_gates, load_write_gates
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib

CALIBRATION_SEED = 20_000  # disjoint from training (< 10000) and evaluation (10000 + task)
SINKS = 4


def ring_bytes_per_slot(model) -> int:
    """Bytes one more ring slot costs per sequence (all layers and KV heads)."""
    cfg = model.config

    def ring(window):
        return LocalRing.create(
            num_layers=cfg.num_layers,
            batch=1,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            window=window,
            dtype=model.dtype,
        ).nbytes

    return ring(2) - ring(1)


def calibrated_head_scores(model, corpus, length: int, window: int) -> np.ndarray:
    """DuoAttention's head choice score [L, K] on 2 held-out calibration texts."""
    rng = np.random.default_rng(CALIBRATION_SEED)
    rows = [[BOS, *corpus.text(rng, length - 1)] for _ in range(2)]
    tokens = jax.numpy.asarray(rows, jax.numpy.int32)
    return np.asarray(policies.long_range_attention_mass(model, tokens, sinks=SINKS, window=window))


def equal_memory_runs(model, head_scores, wgkv_memory, full_memory, *, window, tau):
    """(label, policy, params) at WG-KV's measured memory per sequence (bytes)."""
    ring_bytes = window * ring_bytes_per_slot(model)
    local_window = max(1, int(wgkv_memory // ring_bytes_per_slot(model)) - SINKS)
    fraction = float(np.clip((wgkv_memory - ring_bytes) / max(full_memory - ring_bytes, 1), 0, 1))
    duo = policies.DuoAttention(tau=tau, window=window, sinks=SINKS)
    runs = [("local_attention", policies.LocalAttention(window=local_window, sinks=SINKS), None)]
    # Whole heads retrieve: the head counts just below and just above WG-KV's memory.
    heads = head_scores.size
    for count in sorted({int(np.floor(fraction * heads)), int(np.ceil(fraction * heads))}):
        chosen = policies.retrieval_heads(head_scores, count / heads)
        runs.append((f"duo_attention {count}/{heads} heads", duo, chosen))
    return runs


def run(model, corpus, gate_sets, *, window, tau, length, samples, tasks, read_budget, log=print):
    rows = []

    def record(label, gates_name, policy, params, task, **extra):
        result = run_task(model, policy, corpus, task, length, samples, params)
        row = {"policy": label, "gates": gates_name, "length": length, "task": task, **extra}
        rows.append({**row, "samples": samples, **result})
        log(json.dumps(rows[-1]))
        return result

    full = {t: record("full", None, policies.FullCache(), None, t) for t in tasks}
    head_scores = calibrated_head_scores(model, corpus, length, window)
    quest = policies.Quest(budget=read_budget)
    for task in tasks:
        record("quest", None, quest, None, task, read_budget=read_budget)
    for gates_name, gates in gate_sets:
        wgkv = policies.WGKV(tau=tau, window=window)
        composed = policies.compose(wgkv, policies.Quest(budget=max(read_budget - window, 1)))
        for task in tasks:
            measured = record("wgkv", gates_name, wgkv, gates, task)
            memory = measured["kv_bytes_per_sequence"]
            full_memory = full[task]["kv_bytes_per_sequence"]
            for label, policy, params in equal_memory_runs(
                model, head_scores, memory, full_memory, window=window, tau=tau
            ):
                record(label, gates_name, policy, params, task)
            record("wgkv+quest", gates_name, composed, gates, task, read_budget=read_budget)
    return rows


def gates_label(path: Path) -> str:
    """`assets/wgkv-gates/lambda-0.02/gates.safetensors` -> `lambda-0.02`."""
    return path.parent.name if path.stem == "gates" else path.stem


def markdown_table(rows) -> str:
    lines = [
        "| gates | policy | task | read budget | KV KiB/seq | accuracy | samples |",
        "|" + " --- |" * 7,
    ]
    for r in rows:
        lines.append(
            f"| {r['gates'] or ''} | {r['policy']} | {r['task']} | {r.get('read_budget', '')} | "
            f"{r['kv_bytes_per_sequence'] / 1024:.0f} | {r['accuracy']:.2f} | {r['samples']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench wgkv_quality", description=__doc__)
    parser.add_argument("--model", type=Path, default=bundled.REFERENCE_MODEL)
    parser.add_argument("--gates", type=Path, nargs="*", default=[], help="write gate files")
    parser.add_argument("--fast", action="store_true", help="random gates, 512 bytes, 2 samples")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--read-budget", type=int, help="Quest's tokens per head (default L/4)")
    parser.add_argument("--tasks", nargs="*", default=["needle", "multikey"])
    parser.add_argument("--out", type=Path, default=Path("wgkv-quality"))
    args = parser.parse_args(argv)
    if args.fast:
        args.length, args.samples, args.window = 512, 2, 64
    for task in args.tasks:
        if task not in QA_TASKS:
            raise ValueError(f"task={task!r}: allowed are {QA_TASKS} (decode-time tasks)")
    if not args.gates and not args.fast:
        raise ValueError("--gates: give one or more trained write-gate files (or --fast)")
    policies.WGKV(tau=args.tau, window=args.window)  # checks tau and window before loading
    model = load_hf_checkpoint(args.model, dtype="float32")
    if args.fast:
        gate_sets = [("random", init_write_gates(model.config, jax.random.PRNGKey(0)))]
    else:
        gate_sets = [
            (gates_label(path), load_write_gates(path, model.config)) for path in args.gates
        ]
    read_budget = args.read_budget or args.length // 4
    rows = run(
        model,
        corpus_lib.load_corpus("heldout"),
        gate_sets,
        window=args.window,
        tau=args.tau,
        length=args.length,
        samples=args.samples,
        tasks=tuple(args.tasks),
        read_budget=read_budget,
    )
    report = {
        **harness.provenance("jaxkv bench wgkv_quality", argv),
        "args": json.loads(json.dumps(vars(args), default=str)),
        "rows": rows,
    }
    table = markdown_table(rows)
    harness.save(args.out, "wgkv_quality", report, table)
    print(table)
    return report


if __name__ == "__main__":
    main()
