"""Fast KVzip gate training: KVzip reconstruction targets, then per-layer BCE on the frozen model.

Fast KVzip: "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction",
arXiv:2601.17668; KVzip: "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv:2505.23416 (docs/fastkvzip.md).

1. Targets (`--targets PATH`, built when PATH does not exist): contexts of `--length` tokens
   in the model's own ids (plain text of the corpus's train split after `<bos>`, or after a
   chat model's user-turn header: the files' source, or with `--text docstrings` only their
   English docstrings; `--episode-fraction` of them retrieval episodes with training seeds,
   byte-level models only, none by default: the paper trains on general text) are prefilled;
   KVzip's reconstruction (`jaxkv.policies.kvzip`, its repeat prompt in the model's chat
   format) gives every KV pair its target; each token's attention input per layer is stored
   with it. Validation contexts come from the held-out split. Saved as one .npz with the
   options that built it: a later run takes them from it and refuses others.
2. Training: the gate is a per-token function of the attention input, so a batch is a random
   set of tokens; every layer's gate trains on its own BCE (the loss is their sum: the layers'
   parameters and gradients are disjoint). SGD with momentum 0.9 at the paper's lr 0.2, a
   linear warmup from lr/100, then the rate divided by 10 at 50% and 80% of the steps
   (`sgd_optimizer`), or AdamW; through `jaxkv.train.trainer` (mesh, orbax resume, metrics).

    jaxkv train fastkvzip --targets /tmp/fkz/targets.npz --out assets/fastkvzip-gates
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
import optax
from jax.sharding import NamedSharding, PartitionSpec

import jaxkv
from jaxkv import attention as attention_ops
from jaxkv import bundled, tasks
from jaxkv.gates import fastkvzip as gate
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.models import Model, Tokenizer
from jaxkv.models.decoder import (
    attention_input,
    attention_inputs,
    attention_output_and_mlp,
    embed,
    scan_layers,
)
from jaxkv.models.layers import rope_cos_sin
from jaxkv.models.tokenizer import is_byte_tokenizer
from jaxkv.policies.kvzip import (
    DEFAULT_REPLAY_CHUNK,
    context_prefix_ids,
    reconstruction_scores,
    repeat_prompt_ids,
)
from jaxkv.provenance import provenance as run_provenance
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import mesh as mesh_lib
from jaxkv.train import trainer

TRAIN_SEED, VALIDATION_SEED = 1, 2


def layer_inputs(model: Model, tokens: jax.Array) -> jax.Array:
    """[L, B, T, D] every layer's attention input (normed hidden state) in a dense forward."""
    cfg, params = model.config, model.params
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_cos_sin(cfg, positions)

    def layer(x, lp, _):
        q, k, v = attention_inputs(lp, cfg, x, cos, sin)
        attn = attention_ops.causal_attention(q, k, v, sm_scale=cfg.head_dim**-0.5)
        return attention_output_and_mlp(lp, cfg, x, attn), attention_input(lp, cfg, x)

    _, inputs = scan_layers(layer, embed(params, tokens), params["layers"])
    return inputs


def contexts(
    split: str,
    count: int,
    length: int,
    seed: int,
    tokenizer: Tokenizer,
    episode_fraction: float = 0.0,
    text: str = "source",
) -> list[list[int]]:
    """`count` contexts of `length` tokens in `tokenizer`'s ids: what precedes a context
    (`kvzip.context_prefix_ids`: the bos, or a chat model's user turn) and corpus `text`
    (`corpus.TEXTS`); with probability `episode_fraction` a retrieval episode instead
    (byte-level models only)."""
    if not 0 <= episode_fraction <= 1:
        raise ValueError(f"episode_fraction={episode_fraction} must lie in [0, 1]")
    if episode_fraction > 0 and not is_byte_tokenizer(tokenizer):
        raise ValueError(
            f"episode_fraction={episode_fraction}: retrieval episodes are byte-level (the "
            "reference model's); build other models' targets from text (episode_fraction=0)"
        )
    prefix = list(context_prefix_ids(tokenizer))
    corpus = corpus_lib.load_corpus(split, text=text)
    rng = np.random.default_rng([seed, length])
    out = []
    for _ in range(count):
        if rng.random() < episode_fraction:
            kind = tasks.KINDS[int(rng.integers(len(tasks.KINDS)))]
            text = tasks.make_episode(kind, corpus, rng, length - len(prefix)).prompt
            out.append([*prefix, *text[: length - len(prefix)]])
        else:
            out.append([*prefix, *corpus.token_ids(rng, tokenizer, length - len(prefix)).tolist()])
    return out


@functools.partial(jax.jit, static_argnames=("chunk", "repeat_ids", "continue_ids"))
def _inputs_and_targets_jit(model, tokens, kv, *, chunk, repeat_ids, continue_ids):
    lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
    scores = reconstruction_scores(
        model, kv, tokens, lengths, chunk=chunk, repeat_ids=repeat_ids, continue_ids=continue_ids
    )
    return layer_inputs(model, tokens), scores


def inputs_and_targets(
    model: Model,
    batch: list[list[int]],
    chunk: int,
    repeat_ids: tuple[int, ...],
    continue_ids: tuple[int, ...],
):
    """h f16 [B * T, L, D] and targets f32 [B * T, L, K] for equal-length contexts."""
    tokens = jnp.asarray(batch, jnp.int32)
    b, t = tokens.shape
    if t % chunk:
        raise ValueError(f"--length={t} must be a multiple of the replay chunk {chunk}")
    kv = jaxkv.compress_prompt(model, batch, prefill_chunk=chunk)
    h, scores = _inputs_and_targets_jit(
        model, tokens, kv, chunk=chunk, repeat_ids=repeat_ids, continue_ids=continue_ids
    )
    h = np.asarray(h, np.float16).transpose(1, 2, 0, 3).reshape(b * t, model.config.num_layers, -1)
    targets = np.asarray(scores[..., :t]).transpose(1, 3, 0, 2).reshape(b * t, -1, scores.shape[2])
    return h, targets


def build_targets(
    model,
    tokenizer: Tokenizer,
    path: Path,
    *,
    count,
    validation,
    length,
    batch,
    episode_fraction=0.0,
    text="source",
    chunk=DEFAULT_REPLAY_CHUNK,
    log=print,
) -> dict:
    """Writes train and validation inputs/targets to `path` (.npz, with a JSON `provenance`
    entry saying how they were built, which training summaries copy) and returns `provenance`.
    Each array is filled in place, so the peak memory is the file's size (h: 2 * L * D bytes a
    token)."""
    arrays = {}
    prompts = repeat_prompt_ids(tokenizer)
    for split, n, seed, name in (
        ("train", count, TRAIN_SEED, "train"),
        ("heldout", validation, VALIDATION_SEED, "validation"),
    ):
        all_contexts = contexts(split, n, length, seed, tokenizer, episode_fraction, text)
        for start in range(0, n, batch):
            began = time.perf_counter()
            h, t = inputs_and_targets(model, all_contexts[start : start + batch], chunk, **prompts)
            for key, rows in ((f"{name}_h", h), (f"{name}_targets", t)):
                if key not in arrays:
                    arrays[key] = np.empty((n * length, *rows.shape[1:]), rows.dtype)
                arrays[key][start * length : start * length + len(rows)] = rows
            seconds = time.perf_counter() - began
            log(f"{name}: contexts {start + len(h) // length}/{n} ({seconds:.1f} s)")
    provenance = {
        "train_contexts": count,
        "validation_contexts": validation,
        "length": length,
        "episode_fraction": episode_fraction,
        "text": text,
        "seeds": {"train": TRAIN_SEED, "validation": VALIDATION_SEED},
        "replay_chunk": chunk,
    }
    arrays["provenance"] = np.array(json.dumps(provenance))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return provenance


# Options that build the targets: (provenance key, default when the file is built).
BUILD_OPTIONS = {
    "contexts": ("train_contexts", 48),
    "validation_contexts": ("validation_contexts", 8),
    "length": ("length", 2048),
    "episode_fraction": ("episode_fraction", 0.0),
    "text": ("text", "source"),
}


def read_provenance(path: Path) -> dict:
    """The JSON `provenance` entry of a targets file; a ValueError when it has none."""
    with np.load(path) as data:
        if "provenance" not in data:
            raise ValueError(
                f"--targets {path}: no provenance entry (built by an older version); delete "
                "it to rebuild"
            )
        return json.loads(str(data["provenance"]))


def resolve_build_options(
    args: argparse.Namespace, provenance: dict | None, path: Path, options: dict = BUILD_OPTIONS
) -> None:
    """Fills the build options not given (None) with what the targets at `path` were built with
    (`provenance`; files from before `--text` hold the source text), or with `options`'
    defaults ({option: (provenance key, default)}) when there is no file yet; a ValueError
    naming each given option that differs."""
    differ = []
    for name, (key, default) in options.items():
        built = default if provenance is None else provenance.get(key, default)
        given = getattr(args, name)
        if given is None:
            setattr(args, name, built)
        elif provenance is not None and given != built:
            differ.append(f"--{name.replace('_', '-')}={given} (built with {built})")
    if differ:
        raise ValueError(
            f"--targets {path} was built with other options: {', '.join(differ)}; leave them "
            "out, or pass another --targets path to build new ones"
        )


def bce(scores: jax.Array, targets: jax.Array) -> jax.Array:
    """Elementwise binary cross-entropy of soft targets, scores clipped away from 0 and 1."""
    s = jnp.clip(scores, 1e-6, 1 - 1e-6)
    return -(targets * jnp.log(s) + (1 - targets) * jnp.log1p(-s))


def entropy_bce(targets: np.ndarray) -> float:
    """The mean binary entropy of soft targets: the BCE of a predictor that gives them exactly
    (clipped as `bce` clips its scores)."""
    return float(jnp.mean(bce(jnp.asarray(targets, jnp.float32), jnp.asarray(targets))))


def per_layer_loss(params, h: jax.Array, targets: jax.Array) -> jax.Array:
    """f32 [L] mean BCE of each layer's gate; h [N, L, D], targets [N, L, K]."""

    def one_layer(layer_params, layer_h, layer_targets):
        scores = gate.gate_scores(layer_params, layer_h[None])[0]  # [K, N]
        return jnp.mean(bce(scores, layer_targets.T))

    return jax.vmap(one_layer, in_axes=(0, 1, 1))(params, h.astype(jnp.float32), targets)


def loss_fn(params, batch):
    losses = per_layer_loss(params, batch["h"], batch["targets"])
    return jnp.sum(losses), {f"bce_layer{i}": loss for i, loss in enumerate(losses)}


def sgd_optimizer(steps: int, learning_rate: float, warmup: int):
    """SGD momentum 0.9: linear warmup, then the rate divided by 10 at 50% and 80% of the run."""
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(learning_rate / 100, learning_rate, max(warmup, 1)),
            optax.piecewise_constant_schedule(
                learning_rate, {int(0.5 * steps) - warmup: 0.1, int(0.8 * steps) - warmup: 0.1}
            ),
        ],
        [max(warmup, 1)],
    )
    return optax.sgd(schedule, momentum=0.9)


def targets_parser(stage: str, description: str, options: dict):
    """`jaxkv train STAGE`'s parser with the options of a stage that builds targets once and
    trains on them: --model, --targets, --contexts, --validation-contexts and --length (their
    defaults `options`' (`BUILD_OPTIONS`' form), or what existing targets were built with);
    returns it and `built(name)`, the help text's note for another build option."""
    parser = argparse.ArgumentParser(prog=f"jaxkv train {stage}", description=description)
    parser.add_argument(
        "--model",
        default=str(bundled.REFERENCE_MODEL),
        help="a checkpoint directory, a .gguf file or a fetched model's name (jaxkv fetch)",
    )
    parser.add_argument("--targets", required=True, help=".npz of inputs/targets (built if absent)")

    def built(name: str) -> str:
        return f" (default {options[name][1]}, or what existing --targets were built with)"

    parser.add_argument("--contexts", type=int, help="training contexts" + built("contexts"))
    parser.add_argument(
        "--validation-contexts", type=int, help="held-out contexts" + built("validation_contexts")
    )
    parser.add_argument("--length", type=int, help="tokens per context" + built("length"))
    return parser, built


def token_batches(h: np.ndarray, targets: np.ndarray, batch_tokens: int, seed: int, mesh):
    """`trainer.train`'s batch_for_step for a per-token gate: `batch_tokens` random rows of h
    and targets (drawn with replacement from [seed, step]), this process's share of them."""

    def batch_for_step(step: int):
        rows = np.random.default_rng([seed, step]).integers(0, len(h), batch_tokens)
        return mesh_lib.process_share({"h": h[rows], "targets": targets[rows]}, mesh, 0)

    return batch_for_step


def main(argv=None) -> dict:
    parser, built = targets_parser("fastkvzip", __doc__, BUILD_OPTIONS)
    parser.add_argument("--context-batch", type=int, default=4)
    parser.add_argument(
        "--episode-fraction",
        type=float,
        help="share of contexts that are episodes" + built("episode_fraction"),
    )
    corpus_lib.add_text_argument(parser, default=None, note=built("text"))
    parser.add_argument("--targets-only", action="store_true", help="build targets and stop")
    parser.add_argument(
        "--gate-dim", type=int, default=gate.GATE_DIM, help="D', the gate's projection size"
    )
    parser.add_argument("--sinks", type=int, default=gate.NUM_SINKS, help="S, learned sink keys")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--learning-rate", type=float, default=None, help="sgd 0.2, adamw 3e-3")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for gates.safetensors + metrics")
    parser.add_argument("--work-dir", default=None, help="orbax checkpoints (resumed)")
    mesh_lib.add_mesh_argument(parser)
    args = parser.parse_args(argv)
    for option, value in (("--gate-dim", args.gate_dim), ("--sinks", args.sinks)):
        if value < 1:
            raise ValueError(f"{option}={value} must be >= 1")
    # Rows are tokens (the gate is per token): a seq axis splits them like the batch axes.
    mesh = mesh_lib.cli_mesh(args.mesh, args.batch_tokens, "--batch-tokens", sequence_dim=0)

    targets_path = Path(args.targets)
    provenance = read_provenance(targets_path) if targets_path.exists() else None
    resolve_build_options(args, provenance, targets_path)
    model, tokenizer = load_model(args.model, dtype="float32")
    if provenance is None:
        provenance = build_targets(
            model,
            tokenizer,
            targets_path,
            count=args.contexts,
            validation=args.validation_contexts,
            length=args.length,
            batch=args.context_batch,
            episode_fraction=args.episode_fraction,
            text=args.text,
        )
    if args.targets_only:
        return {}
    data = np.load(targets_path)
    train_h, train_t = data["train_h"], data["train_targets"]
    # Replicated over the mesh, so that validation runs beside the (global) parameters.
    val = jax.device_put(
        {"h": data["validation_h"], "targets": data["validation_targets"]},
        NamedSharding(mesh, PartitionSpec()),
    )

    batch_for_step = token_batches(train_h, train_t, args.batch_tokens, args.seed, mesh)
    validation_loss = jax.jit(per_layer_loss)

    def eval_fn(params, step):
        del step
        losses = validation_loss(params, val["h"], val["targets"])
        return {f"val_bce_layer{i}": float(v) for i, v in enumerate(losses)}

    lr = args.learning_rate or (0.2 if args.optimizer == "sgd" else 3e-3)
    cfg = trainer.TrainConfig(
        steps=args.steps,
        learning_rate=lr,
        warmup_steps=args.warmup,
        weight_decay=0.0,
        grad_clip=1e9,
        checkpoint_every=max(args.steps // 4, 1) if args.work_dir else 0,
        log_every=max(args.steps // 40, 1),
    )
    optimizer = sgd_optimizer(args.steps, lr, args.warmup) if args.optimizer == "sgd" else None
    params = gate.init_params(
        model.config, jax.random.PRNGKey(args.seed), args.gate_dim, args.sinks
    )
    out = Path(args.out) if args.out else None
    if out and jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    state, logged = trainer.train(
        loss_fn,
        params,
        batch_for_step,
        cfg,
        optimizer=optimizer,
        mesh=mesh,
        checkpoint_dir=Path(args.work_dir) / "checkpoints" if args.work_dir else None,
        metrics_path=out / "metrics.jsonl" if out else None,
        eval_fn=eval_fn,
        eval_every=max(args.steps // 10, 1),
        sequence_dim=0,
    )
    seconds = time.perf_counter() - began
    final = logged[-1]
    layers = model.config.num_layers
    params = trainer.gather_to_host(state.params)
    summary = {
        **run_provenance("jaxkv train fastkvzip", argv),
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "targets": provenance,
        "gate_dim": args.gate_dim,
        "num_sinks": args.sinks,
        "optimizer": args.optimizer,
        "learning_rate": lr,
        "steps": args.steps,
        "batch_tokens": args.batch_tokens,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "train_tokens": int(len(train_h)),
        "validation_tokens": int(len(val["h"])),
        "seconds": seconds,
        "seconds_per_step": seconds / args.steps,
        "train_bce": [final[f"bce_layer{i}"] for i in range(layers)],
        "validation_bce": [final[f"val_bce_layer{i}"] for i in range(layers)],
        "validation_bce_of_mean_target": baseline_bce(train_t, val["targets"]),
        "validation_top30_overlap": top_overlap(
            params, data["validation_h"], data["validation_targets"]
        ),
    }
    if out and jax.process_index() == 0:
        gate.save_safetensors(params, out / "gates.safetensors", metadata={"summary": summary})
        (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def top_share(predicted: np.ndarray, targets: np.ndarray, ratio: float = 0.3) -> float:
    """The share of the `ratio` best entries of `targets` that `predicted` (same shape) also
    ranks in its best `ratio` (what eviction at that ratio depends on; chance is `ratio`)."""
    predicted, targets = np.asarray(predicted).ravel(), np.asarray(targets).ravel()
    k = int(ratio * targets.size)
    best_target = set(np.argsort(-targets, kind="stable")[:k].tolist())
    best_predicted = set(np.argsort(-predicted, kind="stable")[:k].tolist())
    return len(best_target & best_predicted) / k


def top_overlap(params, h, targets, ratio: float = 0.3) -> list[float]:
    """Per layer: `top_share` of the gate's scores of tokens x heads; h [N, L, D],
    targets [N, L, K]."""
    overlaps = []
    for layer in range(targets.shape[1]):
        scores = gate.gate_scores(gate.layer_slice(params, layer), jnp.asarray(h[None, :, layer]))
        overlaps.append(top_share(np.asarray(scores[0]).T, targets[:, layer], ratio))
    return overlaps


def baseline_bce(train_targets: np.ndarray, val_targets) -> list[float]:
    """Per layer: the validation BCE of a constant predictor (the train targets' mean)."""
    mean = jnp.asarray(train_targets.mean(axis=(0, 2)))  # [L]
    return [
        float(v) for v in jnp.mean(bce(mean[None, :, None], jnp.asarray(val_targets)), axis=(0, 2))
    ]
