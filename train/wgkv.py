"""Training WG-KV write gates by distillation from the frozen backbone.

WG-KV: "Learning What to Write: Write-Gated KV for Efficient Long-Context Inference",
arXiv:2512.17452 (the gate itself: `jaxkv.gates.wgkv`; this recipe: docs/wgkv.md).

The student is the backbone with write-gated attention: the score of query i on key j gets
log(max(g_j, 1e-3)) added when i - j >= band (nothing inside the band), so a key with a small
gate fades out of attention once it leaves the local window. The teacher is the same backbone
with full causal attention. Only the gates train:

  loss = MSE(final-normed hidden states, student vs teacher)
         + lambda * mean_{l,b,k,s} [o_s + (1 - o_s) (g + g (1 - g))],   o_s = min(band/(T-s), 1)

(o_s: the share of token s's future queries that see it inside the band anyway). Rows are
training-split text prefixed with `PROMPT_PREFIX` (general text, as the paper trains on);
`episode_fraction` of them can instead be retrieval episodes (training seeds), off by default
because those are the kinds the quality benchmark scores. Batches are a pure function of
(seed, step).

    jaxkv train wgkv --sparsity-weight 0.08 --steps 60 --seq-len 1024 --out OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxkv import attention as attention_ops
from jaxkv import bundled, tasks
from jaxkv.attention.dispatch import uses_kernels
from jaxkv.gates import wgkv as gates_lib
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.models import ModelConfig, Tokenizer
from jaxkv.models import layers as model_layers
from jaxkv.models.decoder import (
    attention_input,
    attention_output_and_mlp,
    embed,
    final_hidden,
    project_queries,
    project_unrotated_keys_values,
    scan_layers,
)
from jaxkv.models.tokenizer import is_byte_tokenizer
from jaxkv.provenance import provenance as run_provenance
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import mesh as mesh_lib
from jaxkv.train import pretrain, trainer

PROMPT_PREFIX = "Please analyze and summarize the following text:\n\n"
BOS, EOS, PAD = pretrain.BOS, pretrain.EOS, pretrain.PAD
ADMIT_THRESHOLD = 0.1  # tau: the inference policy admits tokens with g > tau
MIN_EPISODE_SEQ_LEN = 512  # room for a multikey episode's five facts and question


@dataclasses.dataclass(frozen=True)
class GateTraining:
    """What the gates are trained for (the optimizer lives in trainer.TrainConfig).

    Attributes:
      band: W, the local window inside which the gate does not act (and the policy's ring).
      sparsity_weight: lambda, the weight of the admission cost in the loss.
      seq_len: tokens per row.
      batch_size: rows per step (a multiple of the mesh's data x fsdp devices; the paper uses
        one sequence, which a "seq" mesh axis splits over devices).
      episode_fraction: share of rows that are retrieval episodes rather than plain text.
    """

    band: int = 256
    sparsity_weight: float = 0.04
    seq_len: int = 1024
    batch_size: int = 1
    episode_fraction: float = 0.0

    def __post_init__(self):
        if not 1 <= self.band < self.seq_len:
            raise ValueError(
                f"band={self.band} must lie in [1, seq_len={self.seq_len}): a band covering the "
                "whole row leaves the gates nothing to act on"
            )
        if not (math.isfinite(self.sparsity_weight) and self.sparsity_weight >= 0):
            raise ValueError(f"sparsity_weight={self.sparsity_weight} must be finite and >= 0")
        shortest = MIN_EPISODE_SEQ_LEN if self.episode_fraction > 0 else len(PROMPT_PREFIX) + 16
        if self.seq_len < shortest:
            raise ValueError(
                f"seq_len={self.seq_len} must be >= {shortest} (rows of prefixed text"
                + (" and retrieval episodes)" if self.episode_fraction > 0 else ")")
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if not 0 <= self.episode_fraction <= 1:
            raise ValueError(f"episode_fraction={self.episode_fraction} must lie in [0, 1]")


def decoder_hidden(
    backbone,
    cfg: ModelConfig,
    tokens: jax.Array,
    gates=None,
    *,
    band: int = 0,
    backend: str = "xla",
    remat: bool = False,
    mesh: Mesh | None = None,
):
    """Final-normed hidden states [B, T, D] of whole sequences, and the gate values.

    With `gates` (the write-gate tree, leaves [L, ...]) attention is write-gated outside
    `band` and the gate values f32 [L, B, K, T] come back too; without, attention is full
    causal and the second result is None. With a `mesh` that has a "seq" axis, every layer's
    input and output stay split over tokens (`jaxkv.train.mesh.shard_tokens`).
    """
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = model_layers.rope_cos_sin(cfg, positions)
    sm_scale = cfg.head_dim**-0.5

    def layer(x, lp, layer_gates):
        h = attention_input(lp, cfg, x)
        q = project_queries(lp, cfg, h, cos, sin)
        k_unrotated, v = project_unrotated_keys_values(lp, cfg, h)
        k = model_layers.apply_rope(k_unrotated, cos, sin)
        if layer_gates is None:
            attn = attention_ops.causal_attention(q, k, v, sm_scale=sm_scale, backend=backend)
            return attention_output_and_mlp(lp, cfg, x, attn), None
        gate = gates_lib.write_gate_values(layer_gates, k_unrotated, k)
        attn = attention_ops.gated_causal_attention(
            q, k, v, jnp.log(gate), band=band, sm_scale=sm_scale, backend=backend
        )
        return attention_output_and_mlp(lp, cfg, x, attn), gate

    def token_split_layer(x, lp, layer_gates):
        x, gate = layer(mesh_lib.shard_tokens(x, mesh), lp, layer_gates)
        return mesh_lib.shard_tokens(x, mesh), gate

    x, gate_values = scan_layers(
        token_split_layer, embed(backbone, tokens), backbone["layers"], gates, remat=remat
    )
    return final_hidden(backbone, cfg, x), gate_values


def outside_band_weight(valid: jax.Array, band: int) -> jax.Array:
    """o_s = min(band / (T - s), 1) per token f32 [B, T], T the row's valid length."""
    lengths = jnp.sum(valid, axis=1, keepdims=True)
    remaining = jnp.maximum(lengths - jnp.arange(valid.shape[1]), 1)
    return jnp.minimum(band / remaining, 1.0)


def admission_cost(gate_values: jax.Array, valid: jax.Array, band: int) -> jax.Array:
    """mean over layers, rows, heads and valid tokens of o_s + (1-o_s)(g + g(1-g))."""
    o = outside_band_weight(valid, band)[None, :, None, :]
    g = gate_values
    cost = o + (1.0 - o) * (g + g * (1.0 - g))
    weights = jnp.broadcast_to(valid[None, :, None, :], cost.shape).astype(jnp.float32)
    return jnp.sum(cost * weights) / jnp.sum(weights)


def make_loss(
    cfg: ModelConfig,
    spec: GateTraining,
    *,
    backend: str = "xla",
    remat: bool = False,
    mesh: Mesh | None = None,
):
    """loss(params, batch) -> (distillation + lambda * admission cost, metrics).

    params: {"gates": write gates, "backbone": frozen decoder params (gradients stopped)};
    batch: tokens int32 [B, T], valid bool [B, T]. With a `mesh` that has a "seq" axis the
    forwards run split over tokens (sequence parallelism); the loss is the same mean over
    tokens as on one device. A seq axis needs backend "xla": the Pallas attention kernels are
    not partitioned over tokens.
    """
    if mesh is not None and mesh.shape.get(mesh_lib.SEQ_AXIS, 1) > 1 and uses_kernels(backend):
        raise ValueError(
            f"backend={backend!r} with mesh {dict(mesh.shape)}: the Pallas attention kernels are "
            f"not partitioned over tokens, so the {mesh_lib.SEQ_AXIS!r} axis would gather every "
            "token onto each device; use backend 'xla' with a seq axis"
        )

    def loss_fn(params, batch):
        backbone = jax.lax.stop_gradient(params["backbone"])
        tokens, valid = batch["tokens"], batch["valid"]
        teacher, _ = decoder_hidden(backbone, cfg, tokens, backend=backend, mesh=mesh)
        student, gate_values = decoder_hidden(
            backbone,
            cfg,
            tokens,
            params["gates"],
            band=spec.band,
            backend=backend,
            remat=remat,
            mesh=mesh,
        )
        error = jnp.mean(
            jnp.square(student.astype(jnp.float32) - jax.lax.stop_gradient(teacher)), axis=-1
        )
        distillation = jnp.sum(error * valid) / jnp.sum(valid)
        cost = admission_cost(gate_values, valid, spec.band)
        weights = jnp.broadcast_to(valid[None, :, None, :], gate_values.shape)
        admitted = jnp.sum((gate_values > ADMIT_THRESHOLD) * weights) / jnp.sum(weights)
        metrics = {
            "distillation": distillation,
            "admission_cost": cost,
            "admitted_fraction": admitted,
            "mean_gate": jnp.sum(gate_values * weights) / jnp.sum(weights),
        }
        return distillation + spec.sparsity_weight * cost, metrics

    return loss_fn


def encode_row(
    rng: np.random.Generator, corpus, spec: GateTraining, tokenizer: Tokenizer
) -> tuple[np.ndarray, int]:
    """One row: int32 [seq_len] tokens and how many of them are real (the rest padding).

    Text rows are `PROMPT_PREFIX` (after the tokenizer's bos, if it adds one) and corpus text in
    the model's own ids; episode rows (`<bos> prompt answer <eos>`, padded) are byte-level.
    """
    if rng.random() < spec.episode_fraction:
        kind = str(rng.choice(pretrain.EPISODE_KINDS, p=pretrain.EPISODE_WEIGHTS))
        kwargs = {"num_keys": int(rng.integers(2, 6))} if kind == "multikey" else {}
        prompt_length = spec.seq_len - tasks.MAX_ANSWER_BYTES - 2
        episode = tasks.make_episode(kind, corpus, rng, prompt_length, **kwargs)
        tokens, _, _ = pretrain.encode_row(episode, None, spec.seq_len - 1)
        return tokens, int(np.sum(tokens != PAD))
    prefix = tokenizer.encode(PROMPT_PREFIX)
    body = corpus.token_ids(rng, tokenizer, spec.seq_len - len(prefix))
    return np.concatenate([np.asarray(prefix, np.int32), body]), spec.seq_len


def make_batch(
    corpus, spec: GateTraining, seed: int, step: int, tokenizer: Tokenizer
) -> dict[str, np.ndarray]:
    """The batch of `step`: tokens int32 [B, T], valid bool [B, T] (False on padding)."""
    rng = np.random.default_rng([seed, step])
    rows = [encode_row(rng, corpus, spec, tokenizer) for _ in range(spec.batch_size)]
    tokens = np.stack([row for row, _ in rows])
    lengths = np.asarray([length for _, length in rows])
    return {"tokens": tokens, "valid": np.arange(spec.seq_len) < lengths[:, None]}


def gate_decay_mask(gates) -> dict[str, bool]:
    """Weight decay on the MLP weights w1, w2 only (not on norms and biases)."""
    return {name: name in ("w1", "w2") for name in gates}


def check_model(cfg: ModelConfig, spec: GateTraining, tokenizer: Tokenizer) -> None:
    """ValueError when the rows' ids would not fit the model."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer's {tokenizer.vocab_size} ids exceed the model's vocab_size="
            f"{cfg.vocab_size}: give the model's own tokenizer"
        )
    if spec.episode_fraction > 0 and not is_byte_tokenizer(tokenizer):
        raise ValueError(
            f"episode_fraction={spec.episode_fraction}: retrieval episodes are byte-level "
            "(the reference model's); train other models on text (episode_fraction=0)"
        )


def train_gates(
    backbone,
    cfg: ModelConfig,
    spec: GateTraining,
    train_config: trainer.TrainConfig,
    corpus,
    tokenizer: Tokenizer,
    *,
    seed: int = 0,
    expand: float | None = None,
    backend: str = "xla",
    remat: bool = False,
    mesh=None,
    work_dir: Path | None = None,
    stop_after: int | None = None,
    progress: bool = True,
):
    """Trains fresh gates (seeded) on `corpus` in `tokenizer`'s ids; returns (gates, trainer
    state, logged metrics).

    With `work_dir`, checkpoints (resumed from) and metrics.jsonl live there.
    """
    check_model(cfg, spec, tokenizer)
    gates = gates_lib.init_write_gates(cfg, jax.random.PRNGKey(seed), expand=expand)
    # The trainer donates its state: train a copy so that the caller's backbone stays alive.
    params = {"gates": gates, "backbone": jax.tree.map(jnp.array, backbone)}
    trainable = {
        "gates": jax.tree.map(lambda _: True, gates),
        "backbone": jax.tree.map(lambda _: False, backbone),
    }
    decay = {"gates": gate_decay_mask(gates), "backbone": jax.tree.map(lambda _: False, backbone)}
    if work_dir is not None:
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
    mesh = mesh or trainer.make_mesh()
    state, logged = trainer.train(
        make_loss(cfg, spec, backend=backend, remat=remat, mesh=mesh),
        params,
        # Every process builds the step's global batch and feeds its own rows (and tokens).
        lambda step: mesh_lib.process_share(
            make_batch(corpus, spec, seed, step, tokenizer), mesh, 1
        ),
        train_config,
        mesh=mesh,
        trainable=trainable,
        decay_mask=decay,
        checkpoint_dir=work_dir / "checkpoints" if work_dir else None,
        metrics_path=work_dir / "metrics.jsonl" if work_dir else None,
        stop_after=stop_after,
        progress=progress,
        sequence_dim=1,
    )
    return trainer.gather_to_host(state.params["gates"]), state, logged


def evaluate_gates(
    backbone,
    cfg: ModelConfig,
    gates,
    spec: GateTraining,
    corpus,
    tokenizer: Tokenizer,
    *,
    seed: int,
    rows: int = 8,
    backend: str = "xla",
) -> dict[str, float]:
    """Loss terms on `rows` fixed rows of `corpus` (one at a time), averaged over the rows."""
    loss_fn = jax.jit(make_loss(cfg, dataclasses.replace(spec, batch_size=1), backend=backend))
    params = {"gates": gates, "backbone": backbone}
    totals: dict[str, float] = {}
    rng = np.random.default_rng([seed, 1 << 20])
    for _ in range(rows):
        tokens, length = encode_row(rng, corpus, spec, tokenizer)
        valid = np.arange(spec.seq_len) < length
        _, metrics = loss_fn(params, {"tokens": tokens[None], "valid": valid[None]})
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) / rows
    return totals


def gate_train_config(steps: int, learning_rate: float = 1e-3, **overrides) -> trainer.TrainConfig:
    """AdamW lr 1e-3, weight decay 0.01, 10% linear warmup then cosine (to 0)."""
    defaults = dict(
        steps=steps,
        learning_rate=learning_rate,
        warmup_steps=steps // 10,
        final_lr_fraction=0.0,
        weight_decay=0.01,
        b2=0.999,
        log_every=1,
    )
    return trainer.TrainConfig(**{**defaults, **overrides})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv train wgkv", description=__doc__)
    parser.add_argument(
        "--model",
        default=str(bundled.REFERENCE_MODEL),
        help="a checkpoint directory, a .gguf file or a fetched model's name (jaxkv fetch)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for gates + run.json")
    parser.add_argument("--sparsity-weight", type=float, default=0.04, help="lambda")
    parser.add_argument("--band", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--episode-fraction", type=float, default=0.0, help="share of rows that are episodes"
    )
    corpus_lib.add_text_argument(parser)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--expand", type=float, default=None, help="hidden = expand * head_dim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="xla", help="attention backend (xla | pallas)")
    parser.add_argument("--remat", action="store_true", help="recompute layers in the backward")
    parser.add_argument("--eval-rows", type=int, default=8, help="held-out rows for the summary")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--work-dir", type=Path, help="checkpoints and metrics (default OUT/run)")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps in all")
    mesh_lib.add_mesh_argument(parser)
    args = parser.parse_args(argv)
    spec = GateTraining(
        band=args.band,
        sparsity_weight=args.sparsity_weight,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        episode_fraction=args.episode_fraction,
    )
    config = gate_train_config(
        args.steps, args.learning_rate, checkpoint_every=args.checkpoint_every
    )
    mesh = mesh_lib.cli_mesh(args.mesh, spec.batch_size, sequence_dim=1, seq_len=spec.seq_len)
    model, tokenizer = load_model(args.model, dtype="float32")
    work_dir = args.work_dir or args.out / "run"
    started = time.perf_counter()
    gates, state, logged = train_gates(
        model.params,
        model.config,
        spec,
        config,
        corpus_lib.load_corpus("train", text=args.text),
        tokenizer,
        seed=args.seed,
        expand=args.expand,
        backend=args.backend,
        remat=args.remat,
        mesh=mesh,
        work_dir=work_dir,
        stop_after=args.stop_after,
    )
    train_seconds = time.perf_counter() - started
    summary = {
        **run_provenance("jaxkv train wgkv", argv),
        "model": str(args.model),
        "model_file_sha256": model_file_sha256(args.model),
        "seed": args.seed,
        "text": args.text,
        "spec": dataclasses.asdict(spec),
        "steps_done": int(state.step),
        "steps": args.steps,
        "wall_seconds_this_run": train_seconds,
        "device": jax.devices()[0].device_kind,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "final": logged[-1] if logged else None,
    }
    if int(state.step) == args.steps:
        summary["heldout"] = evaluate_gates(
            model.params,
            model.config,
            gates,
            spec,
            corpus_lib.load_corpus("heldout", text=args.text),
            tokenizer,
            seed=args.seed,
            rows=args.eval_rows,
            backend=args.backend,
        )
        summary["heldout"]["rows"] = args.eval_rows
    if int(state.step) == args.steps and jax.process_index() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        gates_lib.save_write_gates(gates, args.out / "gates.safetensors")
        (args.out / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary
