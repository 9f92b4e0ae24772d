"""The trainer: 8 devices equal 1, resumption equals an uninterrupted run, frozen subtrees stay;
meshes: the data and fsdp axes, seq where a stage has tokens to split, others refused, batch rows
checked, the stages' --mesh (sequence parallelism itself: tests/test_sequence_parallel.py)."""

import dataclasses
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from jaxkv import cli
from jaxkv.models import byte_tokenizer, init_model, init_params, save_hf_checkpoint
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import fastkvzip, pretrain, trainer, wgkv
from jaxkv.train import mesh as mesh_lib

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


def test_resumed_run_reaches_the_same_parameters(train_text, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jaxkv")
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
    # A run killed after its last checkpoint had logged steps past it (here 4 and 5).
    with open(tmp_path / "m.jsonl", "a") as killed:
        killed.writelines(json.dumps({"step": step, "loss": 0.0}) + "\n" for step in (4, 5))
    resumed, logged_rest = _run(
        train_text,
        steps=6,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
        metrics_path=tmp_path / "m.jsonl",
    )
    assert int(resumed.step) == 6
    # Without a progress bar (a log file), the resumption and each checkpoint say so.
    said = [r.getMessage() for r in caplog.records if r.name == "jaxkv.train.trainer"]
    assert said[0].startswith("step 2 of 6: loss ")
    assert said[1].startswith("step 3 of 6: loss ")
    assert said[2] == f"resumed from the step-3 checkpoint in {tmp_path}"
    assert [m.split(":")[0] for m in said[3:]] == ["step 4 of 6", "step 6 of 6"]
    assert all(m.endswith(" s a step; writing its checkpoint") for m in said[:2] + said[3:])
    # No step lost or repeated: steps 1-3, then 4-6.
    assert [r["step"] for r in logged_first + logged_rest] == [1, 2, 3, 4, 5, 6]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert _max_difference(resumed.params, whole.params) <= 1e-6


@pytest.mark.parametrize("to_logs", [True, False])
def test_the_cli_shows_training_logs_on_a_piped_stderr_only_while_it_runs(capsys, to_logs):
    log = logging.getLogger("jaxkv.train.trainer")
    with cli._progress_on_stderr(to_logs=to_logs):
        log.info("step 20 of 100: loss 0.5")
    log.info("after the command")
    err = capsys.readouterr().err
    assert err == ("jaxkv: step 20 of 100: loss 0.5\n" if to_logs else "")
    assert not logging.getLogger("jaxkv").handlers


def test_frozen_subtrees_do_not_move(train_text):
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    trainable = jax.tree.map(lambda _: False, params)
    trainable["final_norm"] = True
    state, _ = _run(train_text, trainable=trainable, steps=2)
    assert _max_difference(state.params["layers"], params["layers"]) == 0.0
    assert _max_difference(state.params["embed"], params["embed"]) == 0.0
    assert _max_difference(state.params["final_norm"], params["final_norm"]) > 0.0


def test_checkpoints_hold_what_trains_and_resume_with_the_frozen_rest(train_text, tmp_path):
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    trainable = jax.tree.map(lambda _: False, params)
    trainable["final_norm"] = True
    whole, _ = _run(train_text, trainable=trainable, steps=4)
    _run(
        train_text,
        trainable=trainable,
        steps=4,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
        stop_after=2,
    )
    saved = ocp.StandardCheckpointer().restore(tmp_path / "2" / "default")
    assert int(saved["step"]) == 2
    # The frozen embedding and layers are not in it: one leaf, the final norm's, moved.
    (final_norm,) = saved["trainable_params"]
    assert final_norm.shape == params["final_norm"].shape
    assert np.max(np.abs(np.asarray(final_norm) - np.asarray(params["final_norm"]))) > 0.0
    resumed, _ = _run(
        train_text, trainable=trainable, steps=4, checkpoint_every=2, checkpoint_dir=tmp_path
    )
    assert int(resumed.step) == 4
    assert _max_difference(resumed.params, whole.params) <= 1e-6
    assert _max_difference(resumed.params["layers"], params["layers"]) == 0.0


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


# Meshes: every axis used or refused, batches checked against them, the stages' --mesh.


def test_data_and_fsdp_axes_match_one_device(train_text):
    _, one = _run(train_text, mesh=trainer.make_mesh(jax.devices()[:1]), steps=3)
    state, both = _run(train_text, mesh=mesh_lib.make_mesh(fsdp=2), steps=3)  # data=4, fsdp=2
    assert dict(state.params["layers"]["w_up"].sharding.mesh.shape) == {"data": 4, "fsdp": 2}
    assert state.params["layers"]["w_up"].sharding.spec == P(None, None, "fsdp")
    np.testing.assert_allclose([r["loss"] for r in both], [r["loss"] for r in one], atol=1e-5)


def _quadratic_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2), {}


def _quadratic_run(mesh, rows=8):
    batch = {"x": np.ones((rows, 4), np.float32)}
    cfg = trainer.TrainConfig(steps=1, warmup_steps=0)
    params = {"w": np.ones((4, 2), np.float32)}
    return trainer.train(_quadratic_loss, params, lambda _: batch, cfg, mesh=mesh, progress=False)


def test_unused_mesh_axis_is_refused():
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices())
    with pytest.raises(ValueError, match=r"does not use \('model',\).*\('data', 'fsdp', 'seq'\)"):
        _quadratic_run(mesh)


def test_rows_not_dividing_the_batch_axes_name_them():
    with pytest.raises(ValueError, match=r"has 6 rows, not a multiple of the 8 .*data=4, fsdp=2"):
        _quadratic_run(mesh_lib.make_mesh(fsdp=2), rows=6)


@pytest.mark.parametrize(
    ("text", "sizes"),
    [("data=4", {"data": 4}), ("data=2,fsdp=4", {"data": 2, "fsdp": 4}), ("fsdp=-1", {"fsdp": -1})],
)
def test_parse_mesh(text, sizes):
    assert mesh_lib.parse_mesh(text) == sizes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data=2,model=4", r"axis 'model' is not used by the trainer; supported axes are"),
        ("data", r"'data' is not AXIS=SIZE"),
        ("data=two", r"size 'two' of 'data' is not an integer"),
        ("data=2,data=4", r"'data' given twice"),
        ("data=0", r"data=0 must be >= 1"),
        ("data=-1,fsdp=-1", r"at most one axis may be -1"),
    ],
)
def test_bad_mesh_text(text, message):
    with pytest.raises(ValueError, match=message):
        mesh_lib.parse_mesh(text)


def test_cli_mesh_defaults_and_errors():
    assert dict(mesh_lib.cli_mesh(None, 1).shape) == {"data": 1}  # jaxkv train wgkv's default
    assert dict(mesh_lib.cli_mesh(None, 6).shape) == {"data": 6}
    assert dict(mesh_lib.cli_mesh(None, 32).shape) == {"data": 8}
    assert dict(mesh_lib.cli_mesh("data=-1,fsdp=2", 8).shape) == {"data": 4, "fsdp": 2}
    assert dict(mesh_lib.cli_mesh("fsdp=4", 4).shape) == {"fsdp": 4}
    sequence = mesh_lib.cli_mesh("data=2,seq=-1", 2, sequence_dim=1, seq_len=128)
    assert dict(sequence.shape) == {"data": 2, "seq": 4}
    with pytest.raises(ValueError, match=r"--batch-size a multiple of 8, or pass --mesh data=1"):
        mesh_lib.cli_mesh("data=8", 1)
    with pytest.raises(ValueError, match=r"needs 16 devices .* jax.distributed is not initialised"):
        mesh_lib.cli_mesh("data=16", 16)


@pytest.fixture(scope="module")
def gate_model_dir(tmp_path_factory):
    from tests.test_wgkv_training import CONFIG as GATE_CONFIG

    path = tmp_path_factory.mktemp("gate-model")
    save_hf_checkpoint(init_model(GATE_CONFIG, seed=0, scale=0.3), path)
    byte_tokenizer().save(path)  # a checkpoint directory brings its tokenizer (model_sources)
    return path


WGKV_TINY = ["--seq-len", "128", "--band", "32", "--episode-fraction", "0", "--steps", "2"]
WGKV_TINY += ["--eval-rows", "1", "--checkpoint-every", "0"]


def test_wgkv_stage_default_batch_and_a_two_axis_mesh(gate_model_dir, tmp_path):
    common = ["--model", str(gate_model_dir), *WGKV_TINY]
    default = wgkv.main([*common, "--out", str(tmp_path / "a")])  # batch 1 on 8 devices
    assert default["mesh"] == {"data": 1} and default["steps_done"] == 2
    # The same sequence split over 8 devices: the same run.
    split = wgkv.main([*common, "--out", str(tmp_path / "seq"), "--mesh", "seq=8"])
    assert split["mesh"] == {"seq": 8}
    for name in ("loss", "distillation", "admission_cost"):
        np.testing.assert_allclose(split["final"][name], default["final"][name], rtol=1e-5)
    both = wgkv.main(
        [*common, "--out", str(tmp_path / "b"), "--batch-size", "4", "--mesh", "data=2,fsdp=2"]
    )
    assert (
        both["mesh"] == {"data": 2, "fsdp": 2} and (tmp_path / "b" / "gates.safetensors").exists()
    )


def test_fastkvzip_stage_on_a_three_axis_mesh(gate_model_dir, tmp_path):
    from tests.test_wgkv_training import CONFIG as GATE_CONFIG

    rng = np.random.default_rng(0)
    shape = (GATE_CONFIG.num_layers, GATE_CONFIG.hidden_size)
    targets_shape = (GATE_CONFIG.num_layers, GATE_CONFIG.num_kv_heads)
    np.savez(
        tmp_path / "targets.npz",
        train_h=rng.standard_normal((256, *shape)).astype(np.float16),
        train_targets=rng.random((256, *targets_shape)).astype(np.float32),
        validation_h=rng.standard_normal((32, *shape)).astype(np.float16),
        validation_targets=rng.random((32, *targets_shape)).astype(np.float32),
        provenance=np.array("{}"),
    )
    argv = ["--model", str(gate_model_dir), "--targets", str(tmp_path / "targets.npz")]
    argv += ["--steps", "4", "--warmup", "1", "--batch-tokens", "64"]
    argv += ["--mesh", "data=2,fsdp=2,seq=2"]  # token rows split over all three axes
    summary = fastkvzip.main([*argv, "--out", str(tmp_path / "out")])
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "seq": 2}
    assert np.all(np.isfinite(summary["train_bce"]))
    assert (tmp_path / "out" / "gates.safetensors").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "data=8,model=1"], "axis 'model' is not used by the trainer"),
        (["--mesh", "data=2,seq=4"], "axis 'seq' splits each row's tokens, and this loss has no"),
        (["--mesh", "data=16"], "jax.distributed is not initialised"),
        (["--mesh", "data=3"], "make every phase's batch size a multiple of 3, or pass"),
    ],
)
def test_pretrain_stage_refuses_bad_meshes(argv, message, tmp_path, capsys):
    code = cli.main(["train", "pretrain", "--recipe", "smoke", "--out", str(tmp_path), *argv])
    assert code == 2 and re.search(message, capsys.readouterr().err)
