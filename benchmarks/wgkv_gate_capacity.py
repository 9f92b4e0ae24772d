"""Can WG-KV's write gate pick the tokens KVzip keeps? Its form fitted to KVzip's scores.

WG-KV's gate sees one token's keys (`jaxkv.gates.wgkv`: an MLP per KV head on its normed
unrotated and rotated key) and is trained by distillation; KVzip ranks tokens by how much a
replay of the context attends to them. This fits gates of WG-KV's exact form, all layers at
once, to KVzip's scores (the targets file of `jaxkv train fastkvzip`: each token's attention
input h per layer, from which the model's key projection and RoPE give the gate's inputs, and
its score per KV head) by the BCE with Adam, and scores on the file's held-out contexts:
- the distilled gates (`--gates`, e.g. a step of the long `jaxkv train wgkv` run),
- the fitted gates,
each by validation BCE between the constant predictor's and the targets' entropy (`explained`:
the share of that span removed) and by the top-30% overlap with the targets, per layer and
pooled over layers x heads (KVzip's one threshold). The fitted gates are written to
`--save-gates DIR` (`gates.safetensors`, `run.json`), a WG-KV policy's parameters:
`jaxkv bench real_quality --policies wgkv:tau=T --params wgkv=DIR` then measures the answers
of the gate's form with the oracle's choice learned, the ceiling a distilled gate can reach.

    python -m jaxkv.benchmarks.wgkv_gate_capacity --model smollm2-135m-instruct \\
        --targets /tmp/fkz-smollm2/targets-docs64.npz \\
        --gates assets/wgkv-gates/smollm2-135m-instruct/docstrings-lambda-0.3-2000-step540 \\
        --save-gates /tmp/wgkv-fitted --out results/wgkv/gate-capacity/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv.benchmarks import harness
from jaxkv.gates import wgkv as gate
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.models.decoder import project_unrotated_keys_values
from jaxkv.models.layers import apply_rope, rope_cos_sin
from jaxkv.train.fastkvzip import baseline_bce, bce, entropy_bce, read_provenance, top_share

TAUS = (0.3, 0.1, 0.05, 0.03, 0.02, 0.01)


def gate_values(gates, model, h: jax.Array, positions: jax.Array) -> jax.Array:
    """f32 [N, L, K] every layer's write gate for tokens with attention inputs h [N, L, D]
    (f16 from the targets file) at context positions [N]."""
    cfg = model.config
    cos, sin = rope_cos_sin(cfg, positions[None])

    def one_layer(layer_gates, layer_weights, layer_h):
        k, _ = project_unrotated_keys_values(layer_weights, cfg, layer_h[None].astype(jnp.float32))
        return gate.write_gate_values(layer_gates, k, apply_rope(k, cos, sin))[0].T  # [N, K]

    per_layer = jax.vmap(one_layer, in_axes=(0, 0, 1))(gates, model.params["layers"], h)
    return per_layer.transpose(1, 0, 2)


_values_jit = jax.jit(gate_values)


def all_values(gates, model, h: np.ndarray, length: int, chunk: int = 2048) -> np.ndarray:
    """gate_values over every row of h [N, L, D] (contexts of `length` tokens, in order)."""
    out = []
    for start in range(0, len(h), chunk):
        rows = h[start : start + chunk]
        positions = jnp.arange(start, start + len(rows)) % length
        out.append(np.asarray(_values_jit(gates, model, jnp.asarray(rows), positions)))
    return np.concatenate(out)


def fit_gates(model, h: np.ndarray, targets: np.ndarray, length: int, args) -> tuple[dict, list]:
    """WG-KV gates fitted to targets [N, L, K] from h [N, L, D] by Adam on `batch_tokens`
    random rows a step (cosine decay); returns them and the mean loss of every 100 steps."""
    optimizer = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    gates = gate.init_write_gates(model.config, jax.random.PRNGKey(args.seed))
    state = optimizer.init(gates)

    @jax.jit
    def step(gates, state, model, rows_h, positions, rows_targets):
        def loss(g):
            return jnp.mean(bce(gate_values(g, model, rows_h, positions), rows_targets))

        value, grads = jax.value_and_grad(loss)(gates)
        updates, state = optimizer.update(grads, state, gates)
        return optax.apply_updates(gates, updates), state, value

    rng = np.random.default_rng(args.seed)
    losses, curve = [], []
    for i in range(args.steps):
        rows = np.sort(rng.integers(0, len(h), args.batch_tokens))
        gates, state, value = step(
            gates, state, model, jnp.asarray(h[rows]), jnp.asarray(rows % length), targets[rows]
        )
        losses.append(float(value))
        if (i + 1) % 100 == 0 or i + 1 == args.steps:
            curve.append({"step": i + 1, "bce": float(np.mean(losses))})
            print(f"step {i + 1}/{args.steps}: train BCE {curve[-1]['bce']:.5f}", flush=True)
            losses = []
    return gates, curve


def scored(name: str, values: np.ndarray, targets: np.ndarray, constants, entropies) -> list[dict]:
    """One row per layer and a row "all" of a predictor's gate values [N, L, K]: its BCE and
    explained share averaged over layers, its top-30% overlap pooled over layers x heads (one
    threshold, as KVzip's)."""
    rows = []
    for layer in range(targets.shape[1]):
        loss = float(jnp.mean(bce(jnp.asarray(values[:, layer]), jnp.asarray(targets[:, layer]))))
        span = constants[layer] - entropies[layer]
        rows.append(
            {
                "predictor": name,
                "layer": layer,
                "validation_bce": loss,
                "explained": (constants[layer] - loss) / span,
                "top30_overlap": top_share(values[:, layer], targets[:, layer]),
            }
        )
    rows.append(
        {
            "predictor": name,
            "layer": "all",
            "validation_bce": float(np.mean([r["validation_bce"] for r in rows])),
            "explained": float(np.mean([r["explained"] for r in rows])),
            "top30_overlap": top_share(values, targets),
        }
    )
    return rows


def markdown(rows: list[dict], admitted: dict) -> str:
    names = list(dict.fromkeys(r["predictor"] for r in rows))
    by = {(r["predictor"], r["layer"]): r for r in rows}
    head = " | ".join(f"{n}: explained / top-30%" for n in names)
    lines = [f"| layer | {head} |", "|---" * (1 + len(names)) + "|"]
    for layer in dict.fromkeys(r["layer"] for r in rows):
        cells = " | ".join(
            f"{by[n, layer]['explained']:.2f} / {by[n, layer]['top30_overlap']:.2f}" for n in names
        )
        lines.append(f"| {layer} | {cells} |")
    lines += ["", "| predictor | " + " | ".join(f"g > {t}" for t in TAUS) + " |"]
    lines.append("|---" * (1 + len(TAUS)) + "|")
    for name, shares in admitted.items():
        lines.append(f"| {name} | " + " | ".join(f"{shares[str(t)]:.1%}" for t in TAUS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench wgkv_gate_capacity", description=__doc__)
    parser.add_argument("--model", required=True, help="the model the targets were built with")
    parser.add_argument("--targets", type=Path, required=True, help="jaxkv train fastkvzip's .npz")
    parser.add_argument("--gates", type=Path, required=True, help="distilled WG-KV gates")
    parser.add_argument(
        "--save-gates", type=Path, required=True, help="directory for the fitted gates"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/wgkv/gate-capacity"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    for option, value in (("--steps", args.steps), ("--batch-tokens", args.batch_tokens)):
        if value < 1:
            raise ValueError(f"{option} {value} must be >= 1")
    model, _ = load_model(args.model, dtype="float32")
    distilled = gate.load_write_gates(args.gates, model.config)
    length = read_provenance(args.targets)["length"]
    data = np.load(args.targets)
    train_h, train_targets = data["train_h"], data["train_targets"]
    val_h, val_targets = data["validation_h"], data["validation_targets"]
    if train_h.shape[1] != model.config.num_layers:
        raise ValueError(
            f"--targets {args.targets} holds {train_h.shape[1]} layers; --model {args.model} "
            f"has {model.config.num_layers}"
        )
    began = time.perf_counter()
    fitted, curve = fit_gates(model, train_h, train_targets, length, args)
    fit_seconds = time.perf_counter() - began
    constants = baseline_bce(train_targets, val_targets)
    entropies = [entropy_bce(val_targets[:, layer]) for layer in range(val_targets.shape[1])]
    values = {
        "distilled": all_values(distilled, model, val_h, length),
        "fitted": all_values(fitted, model, val_h, length),
    }
    rows = [
        r for name, v in values.items() for r in scored(name, v, val_targets, constants, entropies)
    ]
    admitted = {name: {str(t): float(np.mean(v > t)) for t in TAUS} for name, v in values.items()}
    report = {
        **harness.provenance("python -m jaxkv.benchmarks.wgkv_gate_capacity", argv),
        "targets": str(args.targets),
        "targets_provenance": read_provenance(args.targets),
        "distilled_gates": str(args.gates),
        "parameters": harness.parameter_count(fitted),
        "fit_seconds": fit_seconds,
        "train_curve": curve,
        "admitted_validation": admitted,
        "rows": rows,
    }
    args.save_gates.mkdir(parents=True, exist_ok=True)
    gate.save_write_gates(fitted, args.save_gates / "gates.safetensors")
    record = {
        "command": report["command"],
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "fitted_to": "KVzip reconstruction scores (BCE)",
        "targets_provenance": report["targets_provenance"],
        "steps": args.steps,
        "batch_tokens": args.batch_tokens,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "fit_seconds": fit_seconds,
        "final_train_bce": curve[-1]["bce"],
        "admitted_validation": admitted["fitted"],
        "pooled_top30_overlap": rows[-1]["top30_overlap"],
    }
    (args.save_gates / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    harness.save(args.out, "gate_capacity", report, markdown(rows, admitted))
    print(markdown(rows, admitted))
    return report


if __name__ == "__main__":
    main()
