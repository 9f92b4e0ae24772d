"""WG-KV gate training: the write-gated forward and its gradients against a plain dense
decoder, the admission cost against numpy, a few steps that lower the loss, resume, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cli
from jaxkv.gates import wgkv as gates_lib
from jaxkv.models import ModelConfig, byte_tokenizer, init_model
from jaxkv.models.configs import Family
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import trainer, wgkv

CONFIG = ModelConfig(
    family=Family.QWEN3,
    vocab_size=259,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    max_position_embeddings=512,
)


def plain_rms(x, w, eps):
    return w * x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def plain_rope(x, positions, theta):
    """Rotate-half RoPE on x [..., T, H] written out from the frequencies."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half) / half)
    angles = positions[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def plain_gate(gp, layer, k_unrotated, k):
    """g [K, T] from keys [K, T, H], the formula of `jaxkv.gates.wgkv` (docs/wgkv.md)."""
    x = jnp.concatenate(
        [
            plain_rms(k_unrotated, gp["norm_unrotated"][layer], 1e-6),
            plain_rms(k, gp["norm_rotated"][layer], 1e-6),
        ],
        axis=-1,
    )
    hidden = jnp.einsum("ktx,kxe->kte", x, gp["w1"][layer]) + gp["b1"][layer][:, None]
    hidden = 0.5 * hidden * (1 + jax.scipy.special.erf(hidden / math.sqrt(2)))
    logit = jnp.einsum("kte,ke->kt", hidden, gp["w2"][layer]) + gp["b2"][layer][:, None]
    return jnp.maximum(jax.nn.sigmoid(logit), 1e-3)


def dense_reference(params, gp, tokens, band):
    """Final-normed hidden states [T, D] of one row, KV heads repeated, masks written out."""
    cfg, eps = CONFIG, CONFIG.rms_norm_eps
    time = tokens.shape[0]
    positions = jnp.arange(time, dtype=jnp.float32)
    x = params["embed"][tokens]
    i, j = np.arange(time)[:, None], np.arange(time)[None, :]
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
        h = plain_rms(x, lp["attn_norm"], eps)
        q = plain_rope(
            plain_rms(jnp.einsum("td,dnh->nth", h, lp["wq"]), lp["q_norm"], eps), positions, 1e4
        )
        k_unrotated = plain_rms(jnp.einsum("td,dkh->kth", h, lp["wk"]), lp["k_norm"], eps)
        k = plain_rope(k_unrotated, positions, 1e4)
        v = jnp.einsum("td,dkh->kth", h, lp["wv"])
        scores = jnp.einsum("nth,nsh->nts", q, jnp.repeat(k, cfg.group_size, axis=0))
        scores = scores / math.sqrt(cfg.head_dim)
        if gp is not None:
            log_gate = jnp.repeat(jnp.log(plain_gate(gp, layer, k_unrotated, k)), cfg.group_size, 0)
            scores = scores + jnp.where(i - j >= band, log_gate[:, None, :], 0.0)
        scores = jnp.where(j <= i, scores, -jnp.inf)
        heads = jax.nn.softmax(scores, axis=-1) @ jnp.repeat(v, cfg.group_size, axis=0)
        x = x + jnp.einsum("nth,nhd->td", heads, lp["wo"])
        m = plain_rms(x, lp["mlp_norm"], eps)
        x = x + (jax.nn.silu(m @ lp["w_gate"]) * (m @ lp["w_up"])) @ lp["w_down"]
    return plain_rms(x, params["final_norm"], eps)


def spread_gates(seed):
    """Gates whose values spread over (0, 1) on the tiny model's keys."""
    gp = gates_lib.init_write_gates(CONFIG, jax.random.PRNGKey(seed))
    return {**gp, "w2": gp["w2"] * 8.0, "b2": gp["b2"] - 1.0}


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0, scale=0.3)


def test_gated_forward_and_gradients_match_dense_reference(model):
    band, time = 5, 24
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, time), 0, 259)
    gp = spread_gates(2)
    probe = jax.random.normal(jax.random.PRNGKey(3), (time, CONFIG.hidden_size))

    def ours(gp):
        hidden, gate_values = wgkv.decoder_hidden(
            model.params, CONFIG, tokens, gp, band=band, remat=True
        )
        return jnp.sum(hidden * probe), (hidden, gate_values)

    def reference(gp):
        hidden = jnp.stack([dense_reference(model.params, gp, row, band) for row in tokens])
        return jnp.sum(hidden * probe), hidden

    (_, (hidden, gate_values)), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(gp)
    (_, expected), expected_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(gp)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(expected), rtol=1e-5, atol=2e-5)
    assert gate_values.shape == (2, 2, 2, time)
    assert 0.1 < float(jnp.mean(gate_values > 0.5)) < 0.9  # gates really vary
    for name in gp:
        scale = float(jnp.max(jnp.abs(expected_grads[name])))
        assert scale > 0, name
        np.testing.assert_allclose(
            np.asarray(grads[name]), np.asarray(expected_grads[name]), atol=1e-5 * scale + 1e-7
        )
    # Full attention: the teacher path equals the dense reference without gates.
    teacher, none = wgkv.decoder_hidden(model.params, CONFIG, tokens)
    assert none is None
    np.testing.assert_allclose(
        np.asarray(teacher[0]),
        np.asarray(dense_reference(model.params, None, tokens[0], band)),
        rtol=1e-5,
        atol=2e-5,
    )


def test_open_gates_reproduce_the_teacher(model):
    tokens = jax.random.randint(jax.random.PRNGKey(4), (1, 40), 0, 259)
    gp = gates_lib.init_write_gates(CONFIG, jax.random.PRNGKey(0))
    gp = {**gp, "w2": jnp.zeros_like(gp["w2"]), "b2": jnp.full_like(gp["b2"], 40.0)}
    student, gate_values = wgkv.decoder_hidden(model.params, CONFIG, tokens, gp, band=3)
    teacher, _ = wgkv.decoder_hidden(model.params, CONFIG, tokens)
    np.testing.assert_array_equal(np.asarray(gate_values), 1.0)
    np.testing.assert_allclose(np.asarray(student), np.asarray(teacher), rtol=1e-5, atol=1e-5)


def test_admission_cost_matches_numpy():
    rng = np.random.default_rng(0)
    gate_values = rng.uniform(0.001, 1, (3, 2, 2, 12)).astype(np.float32)
    valid = np.ones((2, 12), bool)
    valid[1, 9:] = False  # row 1 holds 9 tokens
    band = 4
    total, count = 0.0, 0
    for b, length in enumerate((12, 9)):
        for s in range(length):
            o = min(band / (length - s), 1.0)
            g = gate_values[:, b, :, s]
            total += np.sum(o + (1 - o) * (g + g * (1 - g)))
            count += g.size
    got = wgkv.admission_cost(jnp.asarray(gate_values), jnp.asarray(valid), band)
    np.testing.assert_allclose(float(got), total / count, rtol=1e-6)


@pytest.fixture(scope="module")
def train_text():
    return corpus_lib.load_corpus("train")


BYTES = byte_tokenizer()
SPEC = wgkv.GateTraining(
    band=64, sparsity_weight=0.04, seq_len=512, batch_size=2, episode_fraction=0.5
)


def test_batches_are_prefixed_text_and_episodes(train_text):
    batch = wgkv.make_batch(train_text, SPEC, seed=0, step=3, tokenizer=BYTES)
    again = wgkv.make_batch(train_text, SPEC, seed=0, step=3, tokenizer=BYTES)
    np.testing.assert_array_equal(batch["tokens"], again["tokens"])
    rows = [
        wgkv.make_batch(train_text, SPEC, seed=0, step=s, tokenizer=BYTES)["tokens"]
        for s in range(6)
    ]
    rows = np.concatenate(rows)
    assert rows.shape == (12, 512) and np.all(rows[:, 0] == wgkv.BOS)
    prefix = np.frombuffer(wgkv.PROMPT_PREFIX.encode(), np.uint8)
    prefixed = [np.array_equal(row[1 : 1 + len(prefix)], prefix) for row in rows]
    episodes = [wgkv.EOS in row for row in rows]
    assert any(prefixed) and any(episodes)
    assert all(p != e for p, e in zip(prefixed, episodes, strict=True))


def test_a_few_steps_lower_the_loss_and_resume_equals_uninterrupted(model, train_text, tmp_path):
    cfg = wgkv.gate_train_config(6, 1e-2, checkpoint_every=3)
    mesh = trainer.make_mesh(jax.devices()[:2])
    run = dict(seed=0, mesh=mesh, progress=False)
    gates, state, logged = wgkv.train_gates(
        model.params, CONFIG, SPEC, cfg, train_text, BYTES, work_dir=tmp_path / "a", **run
    )
    assert int(state.step) == 6 and len(logged) == 6
    np.testing.assert_array_equal(  # the backbone is frozen
        np.asarray(state.params["backbone"]["layers"]["wq"]), model.params["layers"]["wq"]
    )
    loss_fn = jax.jit(wgkv.make_loss(CONFIG, SPEC))
    fresh = gates_lib.init_write_gates(CONFIG, jax.random.PRNGKey(0))
    batches = [wgkv.make_batch(train_text, SPEC, seed=0, step=s, tokenizer=BYTES) for s in range(6)]

    def mean_loss(gp):
        params = {"gates": gp, "backbone": model.params}
        return np.mean([float(loss_fn(params, batch)[0]) for batch in batches])

    assert mean_loss(gates) < 0.95 * mean_loss(fresh)

    wgkv.train_gates(
        model.params,
        CONFIG,
        SPEC,
        cfg,
        train_text,
        BYTES,
        work_dir=tmp_path / "b",
        stop_after=3,
        **run,
    )
    resumed, state, _ = wgkv.train_gates(
        model.params, CONFIG, SPEC, cfg, train_text, BYTES, work_dir=tmp_path / "b", **run
    )
    assert int(state.step) == 6
    for name in gates:
        np.testing.assert_allclose(resumed[name], gates[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(band=0), "band=0"),
        (dict(band=512), "band=512"),
        (dict(sparsity_weight=-0.1), "sparsity_weight=-0.1"),
        (dict(sparsity_weight=float("nan")), "sparsity_weight=nan"),
        (dict(seq_len=300, episode_fraction=0.5), "seq_len=300"),
        (dict(seq_len=32), "seq_len=32"),
        (dict(episode_fraction=1.5), "episode_fraction=1.5"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        wgkv.GateTraining(**{"band": 16, "seq_len": 512, **kwargs})


def test_cli_reports_bad_band(tmp_path, capsys):
    code = cli.main(["train", "wgkv", "--out", str(tmp_path), "--band", "0", "--steps", "2"])
    assert code == 2 and "band=0" in capsys.readouterr().err
