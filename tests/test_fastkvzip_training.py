"""Fast KVzip gate training: per-layer BCE against plain numpy; a short SGD run on KVzip targets
of a tiny model lowers every layer's loss and resumes from its orbax checkpoint exactly."""

import jax
import numpy as np

from jaxkv.gates import fastkvzip as gate
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from jaxkv.train import fastkvzip as training
from jaxkv.train import trainer
from tests.test_fastkvzip_gate import numpy_scores
from tests.tiny_models import tiny_config

CONFIG = tiny_config(
    Family.LLAMA, hidden_size=32, intermediate_size=64, head_dim=8, max_position_embeddings=512
)


def test_per_layer_loss_matches_numpy_bce():
    params = gate.init_params(CONFIG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    h = rng.standard_normal((9, 2, 32)).astype(np.float32)
    targets = rng.random((9, 2, 2)).astype(np.float32)
    got = np.asarray(training.per_layer_loss(params, h, targets))
    for layer in range(2):
        s = numpy_scores(jax.tree.map(np.asarray, gate.layer_slice(params, layer)), h[:, layer])
        t = targets[:, layer].T
        expected = -np.mean(t * np.log(s) + (1 - t) * np.log(1 - s))
        np.testing.assert_allclose(got[layer], expected, rtol=1e-5)


def test_sgd_training_lowers_every_layer_loss_and_resumes(tmp_path):
    model = init_model(CONFIG, seed=0, scale=0.3)
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 64, 64).tolist() for _ in range(2)]
    h, targets = training.inputs_and_targets(model, batch, 32, (5, 6, 7), (8, 9))
    assert h.shape == (128, 2, 32) and targets.shape == (128, 2, 2)
    assert np.all((targets > 0) & (targets <= 1))

    def batch_for_step(step):
        rows = np.random.default_rng(step).integers(0, 128, 64)
        return {"h": h[rows], "targets": targets[rows]}

    def fresh():  # the trainer donates its initial state
        return gate.init_params(CONFIG, jax.random.PRNGKey(1))

    cfg = trainer.TrainConfig(steps=30, warmup_steps=2, checkpoint_every=15, log_every=30)
    run = dict(optimizer=training.sgd_optimizer(30, 0.2, 2), checkpoint_dir=tmp_path)
    before = np.asarray(training.per_layer_loss(fresh(), h, targets))
    trainer.train(
        training.loss_fn, fresh(), batch_for_step, cfg, stop_after=15, progress=False, **run
    )
    resumed, _ = trainer.train(
        training.loss_fn, fresh(), batch_for_step, cfg, progress=False, **run
    )
    assert int(resumed.step) == 30
    after = np.asarray(training.per_layer_loss(resumed.params, h, targets))
    assert np.all(after < before - 0.01), (before, after)
