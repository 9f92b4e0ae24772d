"""`jaxkv bench sharding`: the HLO collective counter on a known program, and one tiny run."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxkv.benchmarks import sharding as bench


def _decode_like_hlo() -> str:
    """The optimized HLO of a loop shaped like decode: an unknown number of steps, each running
    a 3-layer scan with one all-reduce per layer, and a step-count branch holding an all-gather."""
    mesh = jax.make_mesh((4,), ("model",), (jax.sharding.AxisType.Auto,))

    def per_device(x, steps):
        def layer(h, _):
            return jax.lax.psum(h, "model") * 0.5, None

        def step(state):
            i, h = state
            h, _ = jax.lax.scan(layer, h, None, length=3)
            h = jax.lax.cond(
                i % 4 == 0,
                lambda h: jax.lax.all_gather(h, "model", tiled=True)[: h.shape[0]],
                lambda h: h,
                h,
            )
            return i + 1, h

        return jax.lax.while_loop(lambda s: s[0] < steps, step, (0, x))[1]

    program = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(PartitionSpec("model"), PartitionSpec()),
            out_specs=PartitionSpec("model"),
            check_vma=False,
        )
    )
    return program.lower(jnp.ones((8, 16)), 5).compile().as_text()


def test_counts_a_layer_loop_per_layer_and_branches_apart():
    counted = bench.decode_step_collectives(_decode_like_hlo())
    assert counted["per_step"]["all-reduce"] == 3
    assert counted["per_step"]["all-reduce elements"] == 3 * 2 * 16
    assert "all-gather" not in counted["per_step"]
    assert counted["eviction_branch"]["all-gather"] == 1


def test_a_predicate_s_branches_count_apart_from_every_step():
    """`lax.cond` on a predicate compiles to true/false computations (not a branch list):
    their collectives run only when the branch does."""
    computations = {
        "step": [
            "%ar = f32[4]{0} all-reduce(f32[4]{0} %x), to_apply=%add",
            "%c = f32[4]{0} conditional(pred[] %p, f32[4]{0} %x, f32[4]{0} %x), "
            "true_computation=%evict, false_computation=%keep",
        ],
        "evict": ["%ag = f32[16]{0} all-gather(f32[4]{0} %x), dimensions={0}"],
        "keep": ["ROOT %x = f32[4]{0} parameter(0)"],
    }
    always, branches = bench.count_collectives(computations, "step")
    assert always["all-reduce"] == 1 and "all-gather" not in always
    assert branches["all-gather"] == 1 and branches["all-gather elements"] == 16


def test_a_loop_of_unknown_trips_inside_a_step_is_a_branch():
    """`run_if` (a while loop of zero or one trips) holds the eviction: its body's collectives
    run only on the steps it does; a scan's (known trips) run every step, per trip."""
    computations = {
        "step": [
            "%w = (pred[], f32[4]{0}) while((pred[], f32[4]{0}) %t), condition=%c, body=%evict",
            "%s = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %u), condition=%c, body=%layer, "
            'backend_config={"known_trip_count":{"n":"3"}}',
        ],
        "c": ["ROOT %p = pred[] parameter(0)"],
        "evict": ["%ag = f32[16]{0} all-gather(f32[4]{0} %x), dimensions={0}"],
        "layer": ["%ar = f32[4]{0} all-reduce(f32[4]{0} %x), to_apply=%add"],
    }
    always, branches = bench.count_collectives(computations, "step")
    assert always["all-reduce"] == 3 and "all-gather" not in always
    assert branches["all-gather"] == 1


def test_one_policy_end_to_end(tmp_path):
    out = tmp_path / "sharding"
    argv = ["--policies", "adakv:0.4", "--context", "192", "--new-tokens", "4"]
    argv += ["--data", "2", "--model-shards", "2", "--out", str(out)]
    report = bench.main(argv)
    (row,) = report["rows"]
    assert row["tokens_equal"], row
    per_device = np.asarray(row["kv_bytes_per_device"])
    assert len(per_device) == 4
    # AdaKV's heads keep unequal shares, in all exactly one device's bytes.
    assert per_device.sum() == row["kv_bytes_one_device"]
    # Two layers, one all-reduce each after attention and after the MLP, one for the loop.
    assert row["collectives"]["per_step"]["all-reduce"] == 2 * 2 + 1
    assert json.loads(out.with_suffix(".json").read_text())["rows"][0]["policy"] == "adakv:0.4"
