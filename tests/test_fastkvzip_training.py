"""Fast KVzip gate training: per-layer BCE against plain numpy; a short SGD run on KVzip targets
of a tiny model lowers every layer's loss and resumes from its orbax checkpoint exactly."""

import json

import jax
import numpy as np
import pytest

from jaxkv.gates import fastkvzip as gate
from jaxkv.models import byte_tokenizer, init_model
from jaxkv.models.configs import Family
from jaxkv.policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import fastkvzip as training
from jaxkv.train import trainer
from tests.test_fastkvzip_gate import numpy_scores
from tests.tiny_models import tiny_config

BYTES = byte_tokenizer()
REPEAT_IDS, CONTINUE_IDS = tuple(REPEAT_PROMPT.encode()), tuple(CONTINUE_PROMPT.encode())
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


def test_contexts_are_general_text_by_default():
    """By default every context is a verbatim stretch of the train split (as the paper trains
    on general text); with episode_fraction=1 none is."""
    train_bytes = corpus_lib.load_corpus("train").data.tobytes()
    general = training.contexts("train", 4, 600, 1, BYTES)
    episodes = training.contexts("train", 4, 600, 1, BYTES, episode_fraction=1.0)
    for context in general:
        assert context[0] == BYTES.bos_id and len(context) == 600
        assert bytes(context[1:]) in train_bytes
    assert not any(bytes(context[1:]) in train_bytes for context in episodes)


def test_docstring_contexts_are_stretches_of_the_docstring_text():
    docs = corpus_lib.load_corpus("train", text="docstrings").data.tobytes()
    for context in training.contexts("train", 3, 700, 1, BYTES, text="docstrings"):
        assert context[0] == BYTES.bos_id and bytes(context[1:]) in docs


@pytest.mark.parametrize("option", ["--gate-dim", "--sinks"])
def test_gate_sizes_below_one_are_refused_before_loading_a_model(option, tmp_path):
    with pytest.raises(ValueError, match=f"{option}=0 must be >= 1"):
        training.main(["--targets", str(tmp_path / "absent.npz"), option, "0"])
    assert not (tmp_path / "absent.npz").exists()


def test_contexts_refuse_a_fraction_outside_0_1():
    with pytest.raises(ValueError, match=r"episode_fraction=1.5 must lie in \[0, 1\]"):
        training.contexts("train", 1, 64, 1, BYTES, episode_fraction=1.5)


def test_targets_carry_their_provenance_and_training_needs_it(tmp_path, monkeypatch):
    """`build_targets` writes each context's rows in order (batches of 2, the last one short)
    and how it built the file; the training summary copies that; a run takes the build options
    from it, refuses given ones that differ, and refuses a targets file without it by name."""

    def fake_inputs_and_targets(model, batch, chunk, *, repeat_ids, continue_ids):
        assert (repeat_ids, continue_ids) == (REPEAT_IDS, CONTINUE_IDS)
        token = np.repeat([context[1] for context in batch], len(batch[0]))  # [B * T]
        h = np.broadcast_to(token[:, None, None], (len(token), 2, 32)).astype(np.float16)
        return h, np.full((len(token), 2, 2), 0.5, np.float32)

    monkeypatch.setattr(training, "inputs_and_targets", fake_inputs_and_targets)
    path = tmp_path / "targets.npz"
    training.build_targets(
        None,
        BYTES,
        path,
        count=3,
        validation=1,
        length=512,
        batch=2,
        episode_fraction=0.25,
        chunk=32,
        log=lambda *_: None,
    )
    data = np.load(path)
    provenance = json.loads(str(data["provenance"]))
    assert provenance["episode_fraction"] == 0.25
    assert (provenance["train_contexts"], provenance["validation_contexts"]) == (3, 1)
    firsts = [context[1] for context in training.contexts("train", 3, 512, 1, BYTES, 0.25)]
    np.testing.assert_array_equal(data["train_h"][:, 1, 7], np.repeat(firsts, 512))
    assert data["validation_h"].shape == (512, 2, 32)
    assert provenance["length"] == 512 and provenance["text"] == "source"

    model = init_model(CONFIG, seed=0, scale=0.3)
    monkeypatch.setattr(training, "load_model", lambda *args, **kwargs: (model, BYTES))
    built = ["--contexts", "3", "--validation-contexts", "1", "--length", "512"]
    argv = ["--targets", str(path), *built, "--episode-fraction", "0.25", "--steps", "2"]
    argv += ["--warmup", "1", "--batch-tokens", "16"]
    summary = training.main(argv)
    assert summary["targets"] == provenance
    assert summary["command"] == "jaxkv train fastkvzip " + " ".join(argv)

    train = ["--steps", "2", "--warmup", "1", "--batch-tokens", "16"]
    assert training.main(["--targets", str(path), *train])["targets"] == provenance
    with pytest.raises(
        ValueError,
        match=r"built with other options: --length=1024 \(built with 512\), "
        r"--text=docstrings \(built with source\); leave them out",
    ):
        training.main(["--targets", str(path), "--length", "1024", "--text", "docstrings"])
    before_text = tmp_path / "before-text.npz"
    arrays = dict(np.load(path))
    without_text = {key: value for key, value in provenance.items() if key != "text"}
    arrays["provenance"] = np.array(json.dumps(without_text))
    np.savez(before_text, **arrays)
    assert training.main(["--targets", str(before_text), "--text", "source", *train])

    old = tmp_path / "old.npz"
    np.savez(old, **{k: v for k, v in np.load(path).items() if k != "provenance"})
    with pytest.raises(ValueError, match="--targets .*old.npz: no provenance entry"):
        training.main(["--targets", str(old), "--steps", "2"])
