"""The trainer: 8 devices equal 1, resumption equals an uninterrupted run, frozen subtrees stay."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxkv  # noqa: F401  (before models: `import models` alone is a circular import today)
from models import init_params
from train import corpus as corpus_lib
from train import pretrain, trainer

RECIPE = pretrain.RECIPES["smoke"]
CONFIG = dataclasses.replace(
    RECIPE.model, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1
)


@pytest.fixture(scope="module")
def train_text():
    return corpus_lib.load_corpus("train")


def _run(train_text, tmp_path=None, *, mesh=None, steps=5, fsdp=False, **kwargs):
    cfg = trainer.TrainConfig(
        steps=steps,
        learning_rate=3e-3,
        warmup_steps=min(1, steps - 1),
        log_every=1,
        fsdp=fsdp,
        checkpoint_every=kwargs.pop("checkpoint_every", 0),
    )
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    recipe = dataclasses.replace(RECIPE, phases=(pretrain.Phase(steps, 512, 8),))
    return trainer.train(
        pretrain.make_loss(CONFIG, "float32", "xla", remat=False),
        params,
        lambda step: pretrain.make_batch(recipe, train_text, 0, step),
        cfg,
        mesh=mesh,
        decay_mask=pretrain.decay_mask(params),
        progress=False,
        **kwargs,
    )


def _max_difference(a, b) -> float:
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree.leaves(diffs))


def test_eight_devices_match_one(train_text):
    assert len(jax.devices()) == 8
    _, one = _run(train_text, mesh=trainer.make_mesh(jax.devices()[:1]))
    _, eight = _run(train_text, mesh=trainer.make_mesh())
    _, sharded = _run(train_text, mesh=trainer.make_mesh(), fsdp=True)
    losses = [row["loss"] for row in one]
    assert len(losses) == 5 and losses[-1] < losses[0]
    np.testing.assert_allclose([row["loss"] for row in eight], losses, atol=1e-5, rtol=0)
    np.testing.assert_allclose([row["loss"] for row in sharded], losses, atol=1e-5, rtol=0)


def test_fsdp_shards_parameters_over_the_data_axis(train_text):
    state, _ = _run(train_text, mesh=trainer.make_mesh(), fsdp=True, steps=1)
    w_up = state.params["layers"]["w_up"]  # [L, D, F]: F = 64 is the largest divisible axis
    assert w_up.sharding.spec == jax.sharding.PartitionSpec(None, None, "data")
    assert w_up.addressable_shards[0].data.shape == (1, 32, 8)
    assert state.params["final_norm"].sharding.spec == jax.sharding.PartitionSpec("data")


def test_resumed_run_reaches_the_same_parameters(train_text, tmp_path):
    whole, _ = _run(train_text, steps=6)
    first, logged_first = _run(
        train_text,
        steps=6,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
        stop_after=3,
        metrics_path=tmp_path / "m.jsonl",
    )
    assert int(first.step) == 3
    resumed, logged_rest = _run(
        train_text,
        steps=6,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
        metrics_path=tmp_path / "m.jsonl",
    )
    assert int(resumed.step) == 6
    # No step lost or repeated: steps 1-3, then 4-6.
    assert [r["step"] for r in logged_first + logged_rest] == [1, 2, 3, 4, 5, 6]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert _max_difference(resumed.params, whole.params) <= 1e-6


def test_frozen_subtrees_do_not_move(train_text):
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    trainable = jax.tree.map(lambda _: False, params)
    trainable["final_norm"] = True
    state, _ = _run(train_text, trainable=trainable, steps=2)
    assert _max_difference(state.params["layers"], params["layers"]) == 0.0
    assert _max_difference(state.params["embed"], params["embed"]) == 0.0
    assert _max_difference(state.params["final_norm"], params["final_norm"]) > 0.0


def test_corrupt_checkpoint_is_a_clear_error(train_text, tmp_path):
    _run(train_text, steps=2, checkpoint_every=2, checkpoint_dir=tmp_path)
    for path in (tmp_path / "2").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "metadata" not in path.name:
            path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="checkpoint step 2 .* cannot be restored"):
        _run(train_text, steps=4, checkpoint_every=2, checkpoint_dir=tmp_path)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"steps": 0}, "steps=0"),
        ({"steps": 5, "warmup_steps": 5}, "warmup_steps"),
        ({"steps": 5, "warmup_steps": 0, "learning_rate": 0.0}, "learning_rate"),
        ({"steps": 5, "warmup_steps": 0, "keep_checkpoints": 0}, "keep_checkpoints"),
    ],
)
def test_bad_train_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        trainer.TrainConfig(**kwargs)


def test_batch_rows_must_divide_over_devices(train_text):
    recipe = dataclasses.replace(RECIPE, phases=(pretrain.Phase(2, 512, 6),))
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="6 rows, not a multiple of the 8 devices"):
        trainer.train(
            pretrain.make_loss(CONFIG, "float32", "xla", remat=False),
            params,
            lambda step: pretrain.make_batch(recipe, train_text, 0, step),
            trainer.TrainConfig(steps=2, warmup_steps=0),
            progress=False,
        )
