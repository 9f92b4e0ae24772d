"""Sequence parallelism: a "seq" mesh axis splits each row's tokens over devices. On 8 devices the
WG-KV loss and its gradients equal one device's, the compiled step holds T/seq tokens per device,
Fast KVzip's token rows split the same way; bad sequence meshes are named errors."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.gates import fastkvzip as fastkvzip_gate
from jaxkv.gates import wgkv as gates_lib
from jaxkv.models import byte_tokenizer, init_model
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import fastkvzip, wgkv
from jaxkv.train import mesh as mesh_lib
from tests.test_fastkvzip_training import CONFIG as FASTKVZIP_CONFIG
from tests.test_wgkv_training import CONFIG

SEQ_LEN = 136  # 17 tokens per device on seq=8; no parameter has a dimension of 136 or 17
MESHES = [({"seq": 8}, 1), ({"data": 2, "seq": 4}, 2)]  # (mesh, rows per batch)


def _gate_params():
    model = init_model(CONFIG, seed=0, scale=0.3)
    return {
        "gates": gates_lib.init_write_gates(CONFIG, jax.random.PRNGKey(0)),
        "backbone": model.params,
    }


def _compiled_loss_and_grad(loss_fn, params, batch, mesh=None, sequence_dim=1):
    """The jitted value_and_grad compiled for `mesh` (params replicated, the batch split as the
    trainer splits it), or for one device."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if mesh is None:
        jitted = jax.jit(grad_fn)
    else:
        replicated = NamedSharding(mesh, PartitionSpec())
        batch_sharding = mesh_lib.batch_sharding(mesh, sequence_dim)
        jitted = jax.jit(grad_fn, in_shardings=(replicated, batch_sharding))
    return jitted.lower(params, batch).compile()


def _assert_trees_close(got, expected):
    def close(path, a, b):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale, err_msg=str(path))

    jax.tree_util.tree_map_with_path(close, got, expected)


@pytest.mark.parametrize(("sizes", "rows"), MESHES, ids=["seq8", "data2_seq4"])
def test_wgkv_loss_and_gradients_split_over_tokens_equal_one_device(sizes, rows):
    spec = wgkv.GateTraining(band=32, seq_len=SEQ_LEN, batch_size=rows, episode_fraction=0.0)
    batch = wgkv.make_batch(corpus_lib.load_corpus("train"), spec, 0, 0, byte_tokenizer())
    params = _gate_params()
    one = _compiled_loss_and_grad(wgkv.make_loss(CONFIG, spec), params, batch)
    (loss, metrics), grads = one(params, batch)
    mesh = mesh_lib.mesh_from_sizes(sizes)
    split = _compiled_loss_and_grad(wgkv.make_loss(CONFIG, spec, mesh=mesh), params, batch, mesh)
    (split_loss, split_metrics), split_grads = split(params, batch)

    np.testing.assert_allclose(split_loss, loss, rtol=1e-5)
    _assert_trees_close(split_metrics, metrics)
    _assert_trees_close(split_grads["gates"], grads["gates"])
    assert float(np.max(np.abs(grads["gates"]["w2"]))) > 0  # the gates get a gradient at all

    # Each device holds its share of the tokens: the residual stream [B/data, T/seq, D], the
    # scores of its queries on all keys [B/data, K, G, T/seq, T]; never the whole sequence's.
    b, t = rows // sizes.get("data", 1), SEQ_LEN // sizes["seq"]
    k, g, d = CONFIG.num_kv_heads, CONFIG.num_heads // CONFIG.num_kv_heads, CONFIG.hidden_size
    hlo = split.as_text()
    assert f"f32[{b},{t},{d}]" in hlo and f"f32[{b},{k},{g},{t},{SEQ_LEN}]" in hlo
    assert f"f32[{b},{SEQ_LEN},{d}]" not in hlo and f"{k},{g},{SEQ_LEN},{SEQ_LEN}]" not in hlo
    # Keys are gathered over the seq axis for attention.
    assert re.search(rf"f32\[{b},{k},{SEQ_LEN},{CONFIG.head_dim}\]\S* all-gather\(", hlo)
    whole = one.as_text()  # the same check sees the whole sequence on one device
    assert f"f32[{rows},{SEQ_LEN},{d}]" in whole


def test_wgkv_training_on_a_seq_mesh_equals_one_device():
    spec = wgkv.GateTraining(band=32, seq_len=128, batch_size=1, episode_fraction=0.0)
    config = wgkv.gate_train_config(2, 1e-2)
    model = init_model(CONFIG, seed=0, scale=0.3)
    corpus = corpus_lib.load_corpus("train")
    runs = {}
    for name, sizes in (("one", {"data": 1}), ("seq", {"seq": 8})):
        mesh = mesh_lib.mesh_from_sizes(sizes)
        runs[name] = wgkv.train_gates(
            model.params, CONFIG, spec, config, corpus, byte_tokenizer(), mesh=mesh, progress=False
        )
    (gates, _, logged), (seq_gates, _, seq_logged) = runs["one"], runs["seq"]
    assert len(logged) == 2
    for row, seq_row in zip(logged, seq_logged, strict=True):
        for name in ("loss", "distillation", "admission_cost", "grad_norm"):
            np.testing.assert_allclose(seq_row[name], row[name], rtol=1e-5, err_msg=name)
    _assert_trees_close(seq_gates, gates)


@pytest.mark.parametrize("sizes", [{"seq": 8}, {"data": 2, "seq": 4}], ids=["seq8", "data2_seq4"])
def test_fastkvzip_loss_split_over_token_rows_equals_one_device(sizes):
    params = fastkvzip_gate.init_params(FASTKVZIP_CONFIG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    layers, dim = FASTKVZIP_CONFIG.num_layers, FASTKVZIP_CONFIG.hidden_size
    batch = {
        "h": rng.standard_normal((64, layers, dim)).astype(np.float16),
        "targets": rng.random((64, layers, FASTKVZIP_CONFIG.num_kv_heads)).astype(np.float32),
    }
    (loss, _), grads = _compiled_loss_and_grad(fastkvzip.loss_fn, params, batch)(params, batch)
    mesh = mesh_lib.mesh_from_sizes(sizes)
    split = _compiled_loss_and_grad(fastkvzip.loss_fn, params, batch, mesh, sequence_dim=0)
    (split_loss, _), split_grads = split(params, batch)
    np.testing.assert_allclose(split_loss, loss, rtol=1e-5)
    _assert_trees_close(split_grads, grads)
    assert f"f16[{64 // 8},{layers},{dim}]" in split.as_text()  # 8 tokens per device


def test_sequence_not_dividing_the_seq_axis_is_named_before_compiling(caplog):
    with pytest.raises(
        ValueError,
        match=r"splits each row's 100 tokens over seq=8 devices: make "
        r"--seq-len a multiple of 8",
    ):
        mesh_lib.cli_mesh("seq=8", 1, sequence_dim=1, seq_len=100)
    spec = wgkv.GateTraining(band=32, seq_len=102, batch_size=2, episode_fraction=0.0)
    model = init_model(CONFIG, seed=0, scale=0.3)
    with (
        jax.log_compiles(True),
        pytest.raises(
            ValueError,
            match=r"\(2, 102\): its tokens \(axis 1\) are not a multiple of the 4 devices on "
            r"the seq axis \(seq=4\)",
        ),
    ):
        wgkv.train_gates(
            model.params,
            CONFIG,
            spec,
            wgkv.gate_train_config(1),
            corpus_lib.load_corpus("train"),
            byte_tokenizer(),
            mesh=mesh_lib.mesh_from_sizes({"data": 2, "seq": 4}),
            progress=False,
        )
    assert "Compiling jit(step)" not in caplog.text  # the train step never compiled


def test_seq_axis_refused_where_unused():
    mesh = mesh_lib.mesh_from_sizes({"seq": 8})
    with pytest.raises(
        ValueError,
        match=r"axis 'seq' splits each row's tokens, and this loss has "
        r"no token axis",
    ):
        mesh_lib.check_axes(mesh)
    spec = wgkv.GateTraining(band=32, seq_len=128, episode_fraction=0.0)
    with pytest.raises(
        ValueError, match=r"Pallas attention kernels are not partitioned over tokens"
    ):
        wgkv.make_loss(CONFIG, spec, backend="interpret", mesh=mesh)
