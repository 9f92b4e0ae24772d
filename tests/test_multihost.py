"""Multi-process training and inference: 2 processes on localhost (CPU devices, gloo
collectives). In training, each feeds its own half of the batch and they reach the losses and
gates of one process fed the whole batch; in inference, sharded `generate` on a (data=2, model=2)
mesh spanning both (rows across the processes, KV heads inside each) gives one device's tokens.

The test starts this file as a script, once per process (`python tests/test_multihost.py
worker ID PORT OUT`): each process gets 2 CPU devices, so the mesh spans 4 devices over 2
processes, and runs two steps of WG-KV gate training through `jaxkv.train.wgkv.train_gates` on a
(data=2, fsdp=2) mesh (data across the processes, fsdp inside each) and on a (seq=4) mesh (each
process feeds its half of every row's tokens).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEVICES_PER_PROCESS = 2
# data=2 across the processes (gradients all-reduced over gloo), fsdp=2 inside each (gates
# sharded, gathered per step): both axes, and the batch split over all 4 devices. seq=4: every
# row's tokens split over the 4 devices, keys and values gathered across the processes.
MESHES = {"data_fsdp": {"data": 2, "fsdp": 2}, "seq": {"seq": 4}}
STEPS = 2


def _setup():
    """Model, spec, config and corpus of the runs (imported lazily: jax must see the child's
    XLA_FLAGS and distributed setup first)."""
    from jaxkv.models import init_model
    from jaxkv.train import corpus as corpus_lib
    from jaxkv.train import wgkv
    from tests.test_wgkv_training import CONFIG

    spec = wgkv.GateTraining(band=32, seq_len=128, batch_size=4, episode_fraction=0.0)
    config = wgkv.gate_train_config(STEPS, 1e-2)
    model = init_model(CONFIG, seed=0, scale=0.3)
    return model, spec, config, corpus_lib.load_corpus("train")


def _train(mesh) -> dict[str, np.ndarray]:
    from jaxkv.models import byte_tokenizer
    from jaxkv.train import wgkv
    from tests.test_wgkv_training import CONFIG

    model, spec, config, corpus = _setup()
    gates, state, logged = wgkv.train_gates(
        model.params,
        CONFIG,
        spec,
        config,
        corpus,
        byte_tokenizer(),
        seed=0,
        mesh=mesh,
        progress=False,
    )
    assert int(state.step) == STEPS
    out = {f"gates_{name}": np.asarray(value) for name, value in gates.items()}
    out["loss"] = np.array([row["loss"] for row in logged])
    out["distillation"] = np.array([row["distillation"] for row in logged])
    return out


def _generate(mesh=None) -> dict[str, np.ndarray]:
    """Greedy tokens and pages of the full cache and of AdaKV (whose layer-wide selection
    gathers every device's scores) on four prompts of `tests.test_sharding`."""
    import jaxkv
    from jaxkv import policies
    from jaxkv.models import init_model
    from tests.test_sharding import CONFIG, sharded_test_prompts

    model = init_model(CONFIG, seed=1, scale=0.3)
    runs = {
        "full": policies.get("full"),
        "adakv": policies.get("adakv", budget=0.3, inner=policies.get("snapkv", window=8)),
    }
    out = {}
    for name, policy in runs.items():
        result = jaxkv.generate(
            model,
            sharded_test_prompts()[:4],
            max_new_tokens=6,
            policy=policy,
            stop_tokens=[],
            mesh=mesh,
        )
        out[f"tokens_{name}"] = result.tokens
        out[f"pages_{name}"] = result.pages_in_use
    return out


def worker(process_id: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id
    )
    from jaxkv.train import mesh as mesh_lib

    assert jax.process_count() == 2 and jax.device_count() == 2 * DEVICES_PER_PROCESS
    results = {}
    for name, sizes in MESHES.items():
        for key, value in _train(mesh_lib.mesh_from_sizes(sizes)).items():
            results[f"{name}/{key}"] = value
    from jaxkv import sharding

    for key, value in _generate(sharding.make_inference_mesh(data=2, model=2)).items():
        results[f"generate/{key}"] = value
    np.savez(out, **results)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_processes_feeding_halves_match_one_process_on_the_whole_batch(tmp_path):
    import jax

    from jaxkv.train import mesh as mesh_lib

    port = _free_port()
    suite_flags = [  # the suite's compile flags (conftest.py), with this test's device count
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": " ".join(
            [f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}", *suite_flags]
        ),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(i), str(port), str(tmp_path / f"{i}.npz")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    # One process, the same 4-device meshes (its first 4 devices), fed the whole batch (while
    # the workers run).
    expected = {name: _train(mesh_lib.mesh_from_sizes(sizes)) for name, sizes in MESHES.items()}
    one_device = _generate()
    for process in workers:
        try:
            output, _ = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            raise
        assert process.returncode == 0, output[-4000:]
    for i in range(2):
        got = np.load(tmp_path / f"{i}.npz")
        for name, runs in expected.items():
            assert len(runs["loss"]) == STEPS
            for key, value in runs.items():
                np.testing.assert_allclose(
                    got[f"{name}/{key}"], value, rtol=1e-5, atol=1e-7, err_msg=f"{i} {name} {key}"
                )
        for key, value in one_device.items():
            np.testing.assert_array_equal(got[f"generate/{key}"], value, err_msg=f"{i} {key}")
    # The gates moved: the comparison is not of two untouched initialisations.
    from jaxkv.gates import wgkv as gates_lib
    from tests.test_wgkv_training import CONFIG

    fresh = gates_lib.init_write_gates(CONFIG, jax.random.PRNGKey(0))
    moved = expected["data_fsdp"]["gates_w2"] - np.asarray(fresh["w2"])
    assert np.max(np.abs(moved)) > 1e-4


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
