"""The attention read benchmark times four ways over the same K and V and checks that paged
attention over a shuffled page table gives dense attention's output."""

import json

import jax
import numpy as np
import pytest

from jaxkv.benchmarks import attention_read

TINY = ["--batch", "2", "--layers", "2", "--kv-heads", "2", "--group", "2", "--head-dim", "16"]
TINY += ["--page-size", "8", "--repeats", "1", "--rounds", "2"]


def test_report_rows_rates_and_ratios(tmp_path):
    out = tmp_path / "read"
    report = attention_read.main([*TINY, "--contexts", "64", "128", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == report["rows"]
    assert report["command"].startswith("jaxkv bench attention_read")
    for row, context in zip(report["rows"], (64, 128), strict=True):
        assert row["kv_bytes"] == 2 * 2 * 2 * 2 * context * 16 * 4
        assert row["max_abs_paged_minus_dense"] <= 1e-4
        for way in attention_read.WAYS:
            assert len(row["seconds"][way]) == 2
            assert row[f"{way}_ms"] == 1e3 * min(row["seconds"][way])
            assert row[f"{way}_gbs"] == pytest.approx(
                row["kv_bytes"] / min(row["seconds"][way]) / 1e9
            )
        for layout in attention_read.LAYOUTS:
            ratio = row[f"paged_{layout}_ms"] / row["dense_ms"]
            assert row[f"paged_{layout}_over_dense"] == pytest.approx(ratio)
    assert "| 128 | 2 |" in out.with_suffix(".md").read_text()


def test_dense_attention_is_softmax_attention():
    q, k, v = (
        jax.random.normal(jax.random.PRNGKey(i), s)
        for i, s in enumerate([(1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)])
    )
    out = attention_read.dense_attention(q, k, v, sm_scale=0.5)
    for b, head, g in np.ndindex(1, 2, 3):
        scores = np.asarray(k[b, head]) @ np.asarray(q[b, head, g]) * 0.5
        weights = np.exp(scores - scores.max())
        expected = weights @ np.asarray(v[b, head]) / weights.sum()
        np.testing.assert_allclose(out[b, head, g], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", attention_read.LAYOUTS)
def test_pool_holds_each_token_where_the_table_says(layout):
    args = attention_read.parse_args([*TINY, "--contexts", "32"])
    inputs = attention_read.step_inputs(args, 32)
    tables = inputs[layout]["tables"]
    page = np.asarray(tables[1])[1, 0, 2]  # layer 1, sequence 1, head 0, page 2
    np.testing.assert_array_equal(inputs[layout]["k_pool"][page], inputs["k"][1][1, 0, 16:24])
    np.testing.assert_array_equal(inputs[layout]["v_pool"][page], inputs["v"][1][1, 0, 16:24])
    ids = sorted(np.concatenate([np.ravel(table) for table in tables]))
    assert ids == list(range(2 * 2 * 2 * 4))


def test_layouts():
    shape = (2, 1, 2, 5)  # layers, batch, heads, pages
    ordered = attention_read.page_table("ordered", shape, run=2, seed=0)
    np.testing.assert_array_equal(ordered[1, 0, 1], [15, 16, 17, 18, 19])
    prefill = attention_read.page_table("prefill", shape, run=2, seed=0)
    # Chunk by chunk (2 pages a head), layer by layer, head by head; the last chunk has 1 page.
    np.testing.assert_array_equal(prefill[0, 0, 0], [0, 1, 8, 9, 16])
    np.testing.assert_array_equal(prefill[1, 0, 1], [6, 7, 14, 15, 19])
    shuffled = attention_read.page_table("shuffled", shape, run=2, seed=0)
    assert sorted(shuffled.reshape(-1)) == list(range(20))
    assert not np.array_equal(shuffled, ordered)


def test_a_wrong_paged_result_is_caught():
    args = attention_read.parse_args([*TINY, "--contexts", "32"])
    inputs = attention_read.step_inputs(args, 32)
    fns = attention_read.programs(args)
    inputs["prefill"]["v_pool"] = inputs["prefill"]["v_pool"].at[0].add(1.0)
    with pytest.raises(AssertionError, match="paged attention .prefill. differs from dense"):
        attention_read.check_agreement(fns, inputs)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--contexts", "20"], "--contexts: 20 must be a positive multiple of --page-size"),
        (["--contexts", "32", "--page-size", "6"], "--page-size must be a positive power"),
        (["--contexts", "32", "--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_bad_flags_name_the_flag(flags, message):
    with pytest.raises(SystemExit, match=message):
        attention_read.parse_args([*TINY, *flags])
