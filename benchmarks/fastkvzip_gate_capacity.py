"""How much of KVzip's reconstruction scores a per-token predictor learns from the hidden state.

Reads a targets file of `jaxkv train fastkvzip` (each token's attention input h per layer and
its KVzip score per KV head) and the gates trained on it. For each chosen layer, on the file's
held-out contexts: the validation BCE and the top-30% overlap (the share of the best 30% of
tokens x heads by target that a predictor also ranks in its best 30%; chance 0.30) of
- the trained sink-attention gates (`jaxkv.gates.fastkvzip`),
- SwiGLU-MLP probes h -> RMSNorm -> (silu(x Wg) * (x Wu)) Wo -> sigmoid, one score per KV head,
  of each `--hidden` width, trained here with Adam (cosine decay) on the file's training rows,
between the two bounds of the BCE: the constant predictor (the training targets' mean) and the
targets' own mean binary entropy (a predictor that gives every target exactly). `explained` is
(constant - BCE) / (constant - entropy): the share of the learnable loss a predictor removes.
A probe that clearly beats the gates says the gate's form, not the hidden state, is what
limits it on this model; one no better says a per-token score cannot get closer.

    python -m jaxkv.benchmarks.fastkvzip_gate_capacity \
        --targets /tmp/fkz-smollm2/targets-docs64.npz \
        --gates assets/fastkvzip-gates/smollm2-135m-instruct/docstrings-64 \
        --layers 0 1 4 11 14 --hidden 96 256 --out results/fastkvzip/gate-capacity
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv.benchmarks import harness
from jaxkv.gates import fastkvzip as gate
from jaxkv.train.fastkvzip import baseline_bce, bce, entropy_bce, top_share

PROBE_BIAS = -3.0  # sigmoid(-3) = 0.047: near the targets' mean at the start


def init_probe(key: jax.Array, hidden_size: int, width: int, heads: int) -> dict:
    """f32 SwiGLU probe: projections N(0, 1/D), a zero output layer, a unit norm."""
    gate_key, up_key = jax.random.split(key)
    scale = hidden_size**-0.5
    return {
        "norm": jnp.ones((hidden_size,), jnp.float32),
        "w_gate": scale * jax.random.normal(gate_key, (hidden_size, width), jnp.float32),
        "w_up": scale * jax.random.normal(up_key, (hidden_size, width), jnp.float32),
        "w_out": jnp.zeros((width, heads), jnp.float32),
        "bias": jnp.full((heads,), PROBE_BIAS, jnp.float32),
    }


def probe_scores(params: dict, h: jax.Array) -> jax.Array:
    """f32 [N, K] keep scores of the probe for h [N, D]."""
    h = h.astype(jnp.float32)
    x = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + gate.NORM_EPS)
    x = x * params["norm"]
    inner = jax.nn.silu(x @ params["w_gate"]) * (x @ params["w_up"])
    return jax.nn.sigmoid(inner @ params["w_out"] + params["bias"])


def train_probe(
    h: np.ndarray, targets: np.ndarray, *, width: int, steps: int, batch: int, lr: float, seed: int
) -> dict:
    """A probe fitted to h [N, D] -> targets [N, K] by Adam on `batch` random rows a step."""
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, steps))
    params = init_probe(jax.random.PRNGKey(seed), h.shape[1], width, targets.shape[1])
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, rows_h, rows_targets):
        def loss(p):
            return jnp.mean(bce(probe_scores(p, rows_h), rows_targets))

        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = rng.integers(0, len(h), batch)
        params, state = step(params, state, jnp.asarray(h[rows]), jnp.asarray(targets[rows]))
    return params


def _scored(name: str, parameters: int, scores: jax.Array, targets: np.ndarray, bounds) -> dict:
    constant, entropy = bounds
    loss = float(jnp.mean(bce(scores, jnp.asarray(targets))))
    return {
        "predictor": name,
        "parameters": parameters,
        "validation_bce": loss,
        "explained": (constant - loss) / (constant - entropy),
        "top30_overlap": top_share(np.asarray(scores), targets),
    }


def layer_report(layer: int, data, gates: dict, constant_bce: float, args) -> list[dict]:
    """Every predictor's row for one layer (data: the targets file's arrays; `constant_bce`:
    the layer's `baseline_bce`)."""
    train_h, train_targets = data["train_h"][:, layer], data["train_targets"][:, layer]
    val_h, val_targets = data["validation_h"][:, layer], data["validation_targets"][:, layer]
    bounds = (constant_bce, entropy_bce(val_targets))
    layer_gates = gate.layer_slice(gates, layer)
    gate_size = harness.parameter_count(layer_gates)
    gate_rows = gate.gate_scores(layer_gates, jnp.asarray(val_h)[None])[0].T  # [N, K]
    rows = [_scored("sink-attention gates", gate_size, gate_rows, val_targets, bounds)]
    for width in args.hidden:
        began = time.perf_counter()
        probe = train_probe(
            train_h,
            train_targets,
            width=width,
            steps=args.steps,
            batch=args.batch_tokens,
            lr=args.learning_rate,
            seed=args.seed + layer,
        )
        row = _scored(
            f"mlp-{width}",
            harness.parameter_count(probe),
            probe_scores(probe, val_h),
            val_targets,
            bounds,
        )
        rows.append({**row, "seconds": time.perf_counter() - began})
    return [
        {"layer": layer, "constant_bce": bounds[0], "entropy_bce": bounds[1], **row} for row in rows
    ]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| layer | predictor | parameters | validation BCE | constant | entropy | explained "
        "| top-30% overlap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['predictor']} | {r['parameters']:,} | {r['validation_bce']:.4f} "
            f"| {r['constant_bce']:.4f} | {r['entropy_bce']:.4f} | {r['explained']:.2f} "
            f"| {r['top30_overlap']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench fastkvzip_gate_capacity", description=__doc__
    )
    parser.add_argument("--targets", type=Path, required=True, help="jaxkv train fastkvzip's .npz")
    parser.add_argument("--gates", type=Path, required=True, help="gates trained on them")
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256], help="probe widths")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/fastkvzip/gate-capacity"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    for option, values in (("--hidden", args.hidden), ("--steps", [args.steps])):
        if min(values) < 1:
            raise ValueError(f"{option} {min(values)} must be >= 1")
    if args.batch_tokens < 1:
        raise ValueError(f"--batch-tokens {args.batch_tokens} must be >= 1")
    gates_path = args.gates / "gates.safetensors" if args.gates.is_dir() else args.gates
    gates = gate.load_safetensors(gates_path)
    data = np.load(args.targets)
    layers = data["validation_targets"].shape[1]
    if gates["wq"].shape[0] != layers or not all(0 <= layer < layers for layer in args.layers):
        raise ValueError(
            f"--layers {args.layers}: the targets hold layers 0..{layers - 1} and the gates "
            f"{gates['wq'].shape[0]} layers"
        )
    names = ("train_h", "train_targets", "validation_h", "validation_targets")
    arrays = {name: data[name] for name in names}
    constants = baseline_bce(arrays["train_targets"], arrays["validation_targets"])
    rows = []
    for layer in args.layers:
        rows += layer_report(layer, arrays, gates, constants[layer], args)
        print(markdown(rows[-1 - len(args.hidden) :]), flush=True)
    report = {
        **harness.provenance("python -m jaxkv.benchmarks.fastkvzip_gate_capacity", argv),
        "targets": str(args.targets),
        "gates": str(gates_path),
        "rows": rows,
    }
    harness.save(args.out, "gate_capacity", report, markdown(rows))
    print(markdown(rows))
    return report


if __name__ == "__main__":
    main()
