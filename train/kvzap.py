"""KVzap surrogate training: KVzip+ targets, then a ridge-regression (linear) and an MLP
surrogate per layer, saved as `jaxkv.policies.kvzap` loads them.

KVzap: "KVzap: Fast, Adaptive and Faithful KV Cache Pruning", arXiv:2601.07891; the recipe is
the paper's (and NVIDIA's public training script's), on this project's corpus:

1. Targets (`--targets PATH`, built when PATH does not exist): contexts of `--length` tokens
   (`fastkvzip.contexts`: the corpus's train split after a chat model's user-turn header, or
   the bos) are followed by KVzip's repeat prompt and the context again, and run densely. The
   KVzip+ score of context token i for KV head k is

       log max_{j in the repeated context, n in k's query group} a^n_{ji} ||v_i W_O^n|| / ||h_j||

   (a: attention weights; v_i W_O^n: what head n writes to the residual stream from token i;
   h_j: the query token's attention input), floored at the smallest normal f32 before the
   log. `--tokens-per-context` random tokens of each context are kept with their attention
   inputs h_i (what the surrogate reads). Validation contexts come from the held-out split.
2. The linear surrogate is ridge regression per layer (closed form, `--ridge-alpha`, an
   unpenalised intercept); the MLP (one GELU layer of `--hidden` units per layer, all layers
   trained at once) minimises the mean squared error with AdamW and a cosine schedule through
   `jaxkv.train.trainer` (mesh, orbax resume, metrics).
3. Both are measured on the validation tokens (per layer: MSE, R^2, and the share of the 30%
   best targets they also rank in their best 30%) and written to `--out` as `linear.npz`,
   `mlp.npz` and `run.json`.

    jaxkv train kvzap --model smollm2-135m-instruct --targets /tmp/kvzap/targets.npz \\
        --out assets/kvzap-surrogates/smollm2-135m-instruct/docstrings-96x1024
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxkv import attention as attention_ops
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.models import Model
from jaxkv.models.decoder import (
    attention_input,
    attention_output_and_mlp,
    embed,
    project_keys_values,
    project_queries,
    scan_layers,
)
from jaxkv.models.layers import rope_cos_sin
from jaxkv.policies.kvzap import SurrogateParams, params_file, surrogate_scores
from jaxkv.policies.kvzip import context_prefix_ids, repeat_prompt_ids
from jaxkv.provenance import provenance as run_provenance
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import fastkvzip, trainer
from jaxkv.train import mesh as mesh_lib

HIGHEST = jax.lax.Precision.HIGHEST
SMALLEST_SCORE = float(jnp.finfo(jnp.float32).tiny)
# Options that build the targets: (provenance key, default when the file is built).
BUILD_OPTIONS = {
    "contexts": ("train_contexts", 96),
    "validation_contexts": ("validation_contexts", 8),
    "length": ("length", 1024),
    "tokens_per_context": ("tokens_per_context", 256),
    "text": ("text", "docstrings"),
}


def _kvzip_plus_layer(lp, cfg, x, cos, sin, context: slice, replay: slice):
    """One layer's dense forward and the KVzip+ scores of the `context` tokens from the
    `replay` queries: (x after the layer, (h [B, C, D], log scores f32 [B, K, C]))."""
    h = attention_input(lp, cfg, x)
    q = project_queries(lp, cfg, h, cos, sin)
    k, v = project_keys_values(lp, cfg, h, cos, sin)
    scale = cfg.head_dim**-0.5
    attn = attention_ops.causal_attention(q, k, v, sm_scale=scale)
    t = x.shape[1]
    rows = jnp.arange(t)[replay]
    causal = jnp.arange(t)[None, :] <= rows[:, None]
    weights = attention_ops.attention_probabilities(q[:, :, replay], k, causal, scale)
    weights = weights[..., context] / jnp.linalg.norm(h[:, replay], axis=-1)[:, None, :, None]
    b, num_kv = k.shape[:2]
    group = cfg.num_heads // num_kv
    wo = lp["wo"].reshape(num_kv, group, cfg.head_dim, -1)  # [K, G, H, D]
    written = jnp.einsum("bkch,kghd->bkgcd", v[:, :, context], wo, precision=HIGHEST)
    written_norm = jnp.linalg.norm(written, axis=-1)  # [B, K, G, C]
    best_row = jnp.max(weights, axis=2).reshape(b, num_kv, group, -1)  # [B, K, G, C]
    scores = jnp.max(best_row * written_norm, axis=2)
    log_scores = jnp.log(jnp.maximum(scores, SMALLEST_SCORE))
    return attention_output_and_mlp(lp, cfg, x, attn), (h[:, context], log_scores)


@functools.partial(jax.jit, static_argnames=("context_start", "context_end"))
def kvzip_plus_targets(model: Model, tokens: jax.Array, *, context_start: int, context_end: int):
    """KVzip+ targets of equal-length rows tokens int32 [B, T] that hold a context at
    [context_start, context_end) and end with the same tokens again (the replay): attention
    inputs h f32 [L, B, C, D] of the context tokens and their log scores f32 [L, B, K, C]
    (module docstring)."""
    cfg, params = model.config, model.params
    c = context_end - context_start
    context, replay = slice(context_start, context_end), slice(tokens.shape[1] - c, None)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_cos_sin(cfg, positions)

    def layer(x, lp, _):
        return _kvzip_plus_layer(lp, cfg, x, cos, sin, context, replay)

    _, (h, scores) = scan_layers(layer, embed(params, tokens), params["layers"])
    return h, scores


def replay_rows(contexts: list[list[int]], prefix: int, repeat_ids) -> np.ndarray:
    """int32 [B, T]: each context (its first `prefix` ids the chat header or bos), the repeat
    prompt, then the context's own tokens again."""
    return np.asarray([[*row, *repeat_ids, *row[prefix:]] for row in contexts], np.int32)


def build_targets(model, tokenizer, path: Path, args: argparse.Namespace, log=print) -> dict:
    """Writes train and validation (h f16 [N, L, D], targets f32 [N, L, K]) to `path` (.npz
    with a JSON `provenance` entry) and returns the provenance."""
    prefix = len(context_prefix_ids(tokenizer))
    repeat_ids = repeat_prompt_ids(tokenizer)["repeat_ids"]
    kept = args.tokens_per_context
    if kept > args.length - prefix:
        raise ValueError(
            f"--tokens-per-context {kept} exceeds the {args.length - prefix} context tokens a "
            f"row of --length {args.length} holds after its {prefix}-token header"
        )
    arrays = {}
    for split, n, seed, name in (
        ("train", args.contexts, fastkvzip.TRAIN_SEED, "train"),
        ("heldout", args.validation_contexts, fastkvzip.VALIDATION_SEED, "validation"),
    ):
        rows = fastkvzip.contexts(split, n, args.length, seed, tokenizer, text=args.text)
        rng = np.random.default_rng([seed, kept])
        h_parts, target_parts = [], []
        starts = range(0, n, args.context_batch)
        for start in tqdm(starts, desc=f"KVzip+ targets ({name})", unit="batch", disable=None):
            batch = replay_rows(rows[start : start + args.context_batch], prefix, repeat_ids)
            h, scores = kvzip_plus_targets(
                model, jnp.asarray(batch), context_start=prefix, context_end=args.length
            )
            h, scores = np.asarray(h), np.asarray(scores)
            for row in range(len(batch)):
                picked = np.sort(rng.choice(h.shape[2], kept, replace=False))
                h_parts.append(h[:, row, picked].transpose(1, 0, 2).astype(np.float16))
                # [L, B, K, C] indexed by a row and the picked tokens: [n, L, K]
                target_parts.append(scores[:, row, :, picked])
        arrays[f"{name}_h"] = np.concatenate(h_parts)
        arrays[f"{name}_targets"] = np.concatenate(target_parts).astype(np.float32)
        log(f"{name}: {len(arrays[f'{name}_h'])} tokens")
    provenance = {key: getattr(args, name) for name, (key, _) in BUILD_OPTIONS.items()}
    provenance |= {
        "seeds": {"train": fastkvzip.TRAIN_SEED, "validation": fastkvzip.VALIDATION_SEED},
        "targets": "KVzip+ (log), replay of the whole context in one dense pass",
    }
    arrays["provenance"] = np.array(json.dumps(provenance))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return provenance


def fit_ridge(h: np.ndarray, targets: np.ndarray, alpha: float) -> dict[str, np.ndarray]:
    """Per layer, the ridge regression of targets [N, L, K] on h [N, L, D] with an unpenalised
    intercept: {"weight": f32 [L, D, K], "bias": f32 [L, K]} (`policies.kvzap`'s linear
    surrogate)."""
    weights, biases = [], []
    for layer in range(h.shape[1]):
        x = h[:, layer].astype(np.float64)
        y = targets[:, layer].astype(np.float64)
        x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
        xc, yc = x - x_mean, y - y_mean
        gram = xc.T @ xc + alpha * np.eye(x.shape[1])
        weight = np.linalg.solve(gram, xc.T @ yc)
        weights.append(weight)
        biases.append(y_mean - x_mean @ weight)
    return {
        "weight": np.stack(weights).astype(np.float32),
        "bias": np.stack(biases).astype(np.float32),
    }


def per_layer_mse(params, h: jax.Array, targets: jax.Array) -> jax.Array:
    """f32 [L]: each layer's surrogate's mean squared error; h [N, L, D], targets [N, L, K]."""

    def one_layer(layer_params, layer_h, layer_targets):
        predicted = surrogate_scores(layer_params, layer_h[None])[0]  # [K, N]
        return jnp.mean((predicted - layer_targets.T) ** 2)

    return jax.vmap(one_layer, in_axes=(0, 1, 1))(params, h.astype(jnp.float32), targets)


def loss_fn(params, batch):
    losses = per_layer_mse(params, batch["h"], batch["targets"])
    return jnp.mean(losses), {f"mse_layer{i}": loss for i, loss in enumerate(losses)}


def predictions(params, h: np.ndarray, batch: int = 4096) -> np.ndarray:
    """f32 [N, L, K]: the surrogates' scores of h [N, L, D], `batch` tokens at a time."""
    score = jax.jit(jax.vmap(surrogate_scores, in_axes=(0, 2)))  # h [1, n, L, D]
    parts = []
    for start in range(0, len(h), batch):
        chunk = jnp.asarray(h[start : start + batch], jnp.float32)
        parts.append(np.asarray(score(params, chunk[None]))[:, 0].transpose(2, 0, 1))
    return np.concatenate(parts)


def fit_report(predicted: np.ndarray, targets: np.ndarray) -> dict:
    """Per layer over the tokens x heads of predicted and targets [N, L, K]: MSE, R^2 and
    `fastkvzip.top_share` at 30% (chance 0.3), with their means."""
    layers = range(targets.shape[1])
    mse = [float(np.mean((predicted[:, i] - targets[:, i]) ** 2)) for i in layers]
    r2 = [1 - m / float(np.var(targets[:, i])) for i, m in zip(layers, mse, strict=True)]
    top = [fastkvzip.top_share(predicted[:, i], targets[:, i]) for i in layers]
    report = {"mse": mse, "r2": r2, "top30_overlap": top}
    return {f"{name}_mean": float(np.mean(v)) for name, v in report.items()} | report


def train_mlp(args, params, train_h, train_t, val, metrics_path: Path | None, mesh):
    """AdamW on the mean squared error over random token batches; the trained parameters."""

    batch_for_step = fastkvzip.token_batches(train_h, train_t, args.batch_tokens, args.seed, mesh)
    validation_mse = jax.jit(per_layer_mse)

    def eval_fn(params, step):
        del step
        return {"val_mse": float(jnp.mean(validation_mse(params, val["h"], val["targets"])))}

    cfg = trainer.TrainConfig(
        steps=args.steps,
        learning_rate=args.learning_rate,
        warmup_steps=min(args.warmup, args.steps - 1),
        final_lr_fraction=0.0,
        weight_decay=args.weight_decay,
        grad_clip=1.0,
        checkpoint_every=max(args.steps // 4, 1) if args.work_dir else 0,
        log_every=max(args.steps // 40, 1),
    )
    state, _ = trainer.train(
        loss_fn,
        params,
        batch_for_step,
        cfg,
        mesh=mesh,
        checkpoint_dir=Path(args.work_dir) / "checkpoints" if args.work_dir else None,
        metrics_path=metrics_path,
        eval_fn=eval_fn,
        eval_every=max(args.steps // 10, 1),
        sequence_dim=0,
    )
    return trainer.gather_to_host(state.params)


def parser() -> argparse.ArgumentParser:
    p, built = fastkvzip.targets_parser("kvzap", __doc__, BUILD_OPTIONS)
    p.add_argument(
        "--tokens-per-context",
        type=int,
        help="random tokens of each context kept" + built("tokens_per_context"),
    )
    corpus_lib.add_text_argument(p, default=None, note=built("text"))
    p.add_argument("--context-batch", type=int, default=2, help="contexts a pass")
    p.add_argument("--targets-only", action="store_true", help="build targets and stop")
    p.add_argument("--ridge-alpha", type=float, default=1.0, help="the linear surrogate's L2")
    p.add_argument("--hidden", type=int, default=128, help="the MLP's units per layer")
    p.add_argument("--steps", type=int, default=1500, help="MLP optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for linear.npz, mlp.npz, run.json")
    p.add_argument("--work-dir", default=None, help="orbax checkpoints of the MLP (resumed)")
    mesh_lib.add_mesh_argument(p)
    return p


def _check(args: argparse.Namespace) -> None:
    for option in ("contexts", "validation_contexts", "length", "tokens_per_context"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} {value} must be >= 1")
    for option in ("context_batch", "hidden", "steps", "batch_tokens"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')} {getattr(args, option)} must be >= 1")
    if args.ridge_alpha <= 0 or args.learning_rate <= 0:
        raise ValueError(
            f"--ridge-alpha {args.ridge_alpha} and --learning-rate {args.learning_rate} must be > 0"
        )


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    _check(args)
    mesh = mesh_lib.cli_mesh(args.mesh, args.batch_tokens, "--batch-tokens", sequence_dim=0)
    targets_path = Path(args.targets)
    provenance = fastkvzip.read_provenance(targets_path) if targets_path.exists() else None
    fastkvzip.resolve_build_options(args, provenance, targets_path, BUILD_OPTIONS)
    model, tokenizer = load_model(args.model, dtype="float32")
    target_seconds = None  # targets read from an earlier run's file
    if provenance is None:
        began = time.perf_counter()
        provenance = build_targets(model, tokenizer, targets_path, args)
        target_seconds = time.perf_counter() - began
    if args.targets_only:
        return {}
    data = np.load(targets_path)
    train_h, train_t = data["train_h"], data["train_targets"]
    val_h, val_t = data["validation_h"], data["validation_targets"]
    out = Path(args.out) if args.out else None
    if out and jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)

    began = time.perf_counter()
    surrogates = {"linear": fit_ridge(train_h, train_t, args.ridge_alpha)}
    linear_seconds = time.perf_counter() - began
    began = time.perf_counter()
    init = SurrogateParams("mlp", hidden=args.hidden).init(
        model.config, jax.random.PRNGKey(args.seed)
    )
    val = jax.device_put({"h": val_h, "targets": val_t}, NamedSharding(mesh, PartitionSpec()))
    metrics = out / "metrics.jsonl" if out else None
    surrogates["mlp"] = train_mlp(args, init, train_h, train_t, val, metrics, mesh)
    mlp_seconds = time.perf_counter() - began

    constant = np.broadcast_to(train_t.mean(axis=0), val_t.shape)
    summary = {
        **run_provenance("jaxkv train kvzap", argv),
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "targets": provenance,
        "train_tokens": int(len(train_h)),
        "validation_tokens": int(len(val_h)),
        "ridge_alpha": args.ridge_alpha,
        "mlp": {
            "hidden": args.hidden,
            "steps": args.steps,
            "batch_tokens": args.batch_tokens,
            "learning_rate": args.learning_rate,
            "warmup": args.warmup,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "mesh": dict(mesh.shape),
        },
        "seconds": {"targets": target_seconds, "linear": linear_seconds, "mlp": mlp_seconds},
        "validation": {
            name: fit_report(predictions(params, val_h), val_t)
            for name, params in surrogates.items()
        }
        | {"train_mean": fit_report(constant, val_t)},
    }
    if out and jax.process_index() == 0:
        for name, params in surrogates.items():
            np.savez(out / params_file(name), **{k: np.asarray(v) for k, v in params.items()})
        (out / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    means = {
        name: {k: v for k, v in report.items() if k.endswith("_mean")}
        for name, report in summary["validation"].items()
    }
    shown = {k: v for k, v in summary.items() if k != "validation"}
    print(json.dumps(shown | {"validation_means": means}, indent=2))
    return summary
