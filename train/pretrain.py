"""Pretraining of the project's reference model: byte-level text plus retrieval episodes.

Each batch row is either plain text of the corpus's train split or a retrieval episode
(`jaxkv.tasks`) built on that text: `<bos> prompt answer <eos>`, padded. Answer tokens weigh
`answer_weight` in the loss (annealed to 1 over the run), padding 0. Sequence length grows in
phases (a curriculum), so that the expensive long steps are few. Batches are a pure function of
(seed, step): a resumed run sees the same data.

    jaxkv train pretrain --recipe reference --out assets/reference-model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv import tasks
from jaxkv.models import Family, Model, ModelConfig, byte_tokenizer, init_params
from jaxkv.models.hf_loading import save_hf_checkpoint
from jaxkv.step.forward import forward
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import mesh as mesh_lib
from jaxkv.train import trainer

BOS, EOS, PAD = 256, 257, 258
EPISODE_KINDS = ("needle", "multikey", "multivalue", "vartrack")
EPISODE_WEIGHTS = (0.25, 0.4, 0.15, 0.2)


@dataclasses.dataclass(frozen=True)
class Phase:
    """Steps [previous phase's end, until) at one sequence length and batch size."""

    until: int
    seq_len: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class Recipe:
    model: ModelConfig
    phases: tuple[Phase, ...]
    learning_rate: float
    warmup_steps: int
    episode_fraction: float  # share of rows that are retrieval episodes
    answer_weight: float  # loss weight of answer tokens at step 0, annealed linearly to 1
    eval_lengths: tuple[int, ...]
    eval_every: int
    checkpoint_every: int
    compute_dtype: str  # "float32" or "bfloat16" (params and optimizer stay f32)

    @property
    def steps(self) -> int:
        return self.phases[-1].until

    def phase(self, step: int) -> Phase:
        for phase in self.phases:
            if step < phase.until:
                return phase
        raise ValueError(f"step={step} is past the recipe's {self.steps} steps")


REFERENCE_MODEL = ModelConfig(
    family=Family.LLAMA,
    vocab_size=259,
    hidden_size=256,
    intermediate_size=768,
    num_layers=6,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=BOS,
    eos_token_ids=(EOS,),
)

RECIPES = {
    # Trained on one lent H100 (see docs/reference-model.md for the command and the curve).
    "reference": Recipe(
        model=REFERENCE_MODEL,
        phases=(Phase(600, 1024, 32), Phase(1300, 2048, 16), Phase(1900, 4096, 8)),
        learning_rate=1.5e-3,
        warmup_steps=100,
        episode_fraction=0.6,
        answer_weight=4.0,
        eval_lengths=(2048, 4096),
        eval_every=200,
        checkpoint_every=400,
        compute_dtype="bfloat16",
    ),
    # Seconds on a CPU: the pipeline end to end (tests, CI).
    "smoke": Recipe(
        model=dataclasses.replace(
            REFERENCE_MODEL,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            head_dim=16,
        ),
        phases=(Phase(4, 512, 8), Phase(6, 768, 8)),
        learning_rate=1e-3,
        warmup_steps=2,
        episode_fraction=0.5,
        answer_weight=4.0,
        eval_lengths=(768,),
        eval_every=3,
        checkpoint_every=2,
        compute_dtype="float32",
    ),
}


def encode_row(episode: tasks.Episode | None, text: bytes | None, seq_len: int):
    """tokens int32 [seq_len + 1], answer mask bool [seq_len] (over targets), valid bool."""
    tokens = np.full(seq_len + 1, PAD, np.int32)
    answer = np.zeros(seq_len, bool)
    if episode is None:
        body = np.frombuffer(text, np.uint8)
        tokens[0], tokens[1 : 1 + len(body)] = BOS, body
    else:
        prompt = np.frombuffer(episode.prompt, np.uint8)
        reply = np.concatenate([np.frombuffer(episode.answer, np.uint8), [EOS]])
        start = 1 + len(prompt)
        tokens[0], tokens[1:start], tokens[start : start + len(reply)] = BOS, prompt, reply
        answer[start - 1 : start - 1 + len(reply)] = True  # targets are tokens[1:]
    valid = tokens[1:] != PAD
    return tokens, answer, valid


def make_batch(recipe: Recipe, corpus, seed: int, step: int, *, batch_size=None, seq_len=None):
    """The batch of `step`: dict of tokens [B, T+1], weights f32 [B, T], answer f32 [B, T]."""
    phase = recipe.phase(step)
    batch_size = batch_size or phase.batch_size
    seq_len = seq_len or phase.seq_len
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(batch_size):
        if rng.random() < recipe.episode_fraction:
            kind = str(rng.choice(EPISODE_KINDS, p=EPISODE_WEIGHTS))
            prompt_length = seq_len - tasks.MAX_ANSWER_BYTES - 2
            kwargs = {"num_keys": int(rng.integers(2, 6))} if kind == "multikey" else {}
            episode = tasks.make_episode(kind, corpus, rng, prompt_length, **kwargs)
            rows.append(encode_row(episode, None, seq_len))
        else:
            rows.append(encode_row(None, corpus.text(rng, seq_len), seq_len))
    tokens, answer, valid = (np.stack(column) for column in zip(*rows, strict=True))
    progress = step / max(recipe.steps - 1, 1)
    answer_weight = recipe.answer_weight + (1.0 - recipe.answer_weight) * progress
    weights = np.where(answer, answer_weight, valid.astype(np.float32)).astype(np.float32)
    return {"tokens": tokens, "weights": weights, "answer": answer.astype(np.float32)}


def _compute_params(params, dtype: str):
    if dtype == "float32":
        return params
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


def make_loss(config: ModelConfig, compute_dtype: str, backend: str, remat: bool):
    """loss(params, batch) -> (weighted cross-entropy, metrics)."""

    def loss_fn(params, batch):
        model = Model(config=config, params=_compute_params(params, compute_dtype))
        tokens = batch["tokens"]
        logits = forward(model, tokens[:, :-1], backend=backend, remat=remat)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        weights = batch["weights"]
        loss = jnp.sum(weights * nll) / jnp.maximum(jnp.sum(weights), 1.0)
        text = (weights > 0) * (1.0 - batch["answer"])
        answer = batch["answer"]
        correct = (jnp.argmax(logits, axis=-1) == tokens[:, 1:]).astype(jnp.float32)
        metrics = {
            "text_bits_per_byte": jnp.sum(text * nll)
            / jnp.maximum(jnp.sum(text), 1.0)
            / math.log(2),
            "answer_token_accuracy": jnp.sum(answer * correct) / jnp.maximum(jnp.sum(answer), 1.0),
        }
        return loss, metrics

    return loss_fn


def make_eval(recipe: Recipe, heldout, seed: int, backend: str, rows: int = 16):
    """Teacher-forced metrics on fixed held-out batches: bits per byte of plain text, and the
    fraction of episodes whose every answer token is the argmax, per evaluation length."""
    loss_fn = make_loss(recipe.model, recipe.compute_dtype, backend, remat=False)

    @jax.jit
    def evaluate(params, batch):
        model = Model(config=recipe.model, params=_compute_params(params, recipe.compute_dtype))
        tokens = batch["tokens"]
        logits = forward(model, tokens[:, :-1], backend=backend)
        wrong = (jnp.argmax(logits, axis=-1) != tokens[:, 1:]) & (batch["answer"] > 0)
        episode = jnp.any(batch["answer"] > 0, axis=1)
        exact = jnp.sum(episode & ~jnp.any(wrong, axis=1)) / jnp.maximum(jnp.sum(episode), 1)
        return exact, loss_fn(params, batch)[1]["text_bits_per_byte"]

    eval_recipe = dataclasses.replace(recipe, episode_fraction=0.5, answer_weight=1.0)
    batches = {
        length: make_batch(eval_recipe, heldout, seed + 1, 0, batch_size=rows, seq_len=length)
        for length in recipe.eval_lengths
    }

    def eval_fn(params, step):
        metrics = {}
        for length, batch in batches.items():
            exact, bpb = evaluate(params, batch)
            metrics[f"eval_answer_exact_{length}"] = float(exact)
            metrics[f"eval_heldout_bits_per_byte_{length}"] = float(bpb)
        return metrics

    return eval_fn


def decay_mask(params):
    """Weight decay on projection and embedding matrices, not on norms."""
    return {
        name: decay_mask(value) if isinstance(value, dict) else not name.endswith("norm")
        for name, value in params.items()
    }


def pretrain(
    recipe_name: str,
    out: Path,
    *,
    seed: int = 0,
    backend: str = "xla",
    work_dir: Path | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    mesh: str | None = None,
) -> dict:
    """Trains `recipe_name`, writes the HF-format model, tokenizer and metrics to `out`.

    mesh: `--mesh` text (jaxkv.train.mesh), default data parallel over the devices that divide every
    phase's batch. With several processes, each feeds its own rows and process 0 writes `out`.
    """
    if recipe_name not in RECIPES:
        raise ValueError(f"recipe={recipe_name!r}: allowed are {sorted(RECIPES)}")
    recipe = RECIPES[recipe_name]
    rows = math.gcd(*(phase.batch_size for phase in recipe.phases))
    device_mesh = mesh_lib.cli_mesh(mesh, rows, "every phase's batch size")
    train_text, heldout = corpus_lib.load_corpus("train"), corpus_lib.load_corpus("heldout")
    work_dir = Path(work_dir or out / "run")
    work_dir.mkdir(parents=True, exist_ok=True)
    params = init_params(recipe.model, jax.random.PRNGKey(seed))
    cfg = trainer.TrainConfig(
        steps=recipe.steps,
        learning_rate=recipe.learning_rate,
        warmup_steps=recipe.warmup_steps,
        checkpoint_every=recipe.checkpoint_every,
        log_every=10,
    )
    started = time.perf_counter()
    state, logged = trainer.train(
        make_loss(recipe.model, recipe.compute_dtype, backend, remat=True),
        params,
        lambda step: mesh_lib.process_share(
            make_batch(recipe, train_text, seed, step), device_mesh
        ),
        cfg,
        mesh=device_mesh,
        decay_mask=decay_mask(params),
        checkpoint_dir=work_dir / "checkpoints",
        metrics_path=work_dir / "metrics.jsonl",
        eval_fn=make_eval(recipe, heldout, seed, backend),
        eval_every=recipe.eval_every,
        stop_after=stop_after,
        progress=progress,
    )
    summary = {
        "recipe": recipe_name,
        "seed": seed,
        "backend": backend,
        "device": jax.devices()[0].device_kind,
        "mesh": dict(device_mesh.shape),
        "processes": jax.process_count(),
        "jax": jax.__version__,
        "steps_done": int(state.step),
        "wall_seconds_this_run": time.perf_counter() - started,
        "final": logged[-1] if logged else None,
        "corpus": {
            "source": "Python standard library .py files",
            "python": corpus_lib.stdlib_root().as_posix(),
            "train_bytes": int(train_text.data.size),
            "heldout_bytes": int(heldout.data.size),
        },
    }
    if int(state.step) == recipe.steps:
        params = trainer.gather_to_host(state.params)
    if int(state.step) == recipe.steps and jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        # Stored in bf16 (half the bytes; the file stays under the 20 MB the repo allows).
        params = jax.tree.map(lambda p: np.asarray(p).astype(jnp.bfloat16), params)
        save_hf_checkpoint(Model(config=recipe.model, params=params), out)
        byte_tokenizer().save(out)
        shutil.copy(work_dir / "metrics.jsonl", out / "metrics.jsonl")
        (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv train pretrain", description=__doc__)
    parser.add_argument("--recipe", default="reference", choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="xla", help="attention backend (xla | pallas)")
    parser.add_argument("--work-dir", type=Path, help="checkpoints and metrics (default OUT/run)")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps in all")
    mesh_lib.add_mesh_argument(parser)
    args = parser.parse_args(argv)
    summary = pretrain(
        args.recipe,
        args.out,
        seed=args.seed,
        backend=args.backend,
        work_dir=args.work_dir,
        stop_after=args.stop_after,
        mesh=args.mesh,
    )
    print(json.dumps(summary, indent=2))
    return summary
