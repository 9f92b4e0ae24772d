"""The benchmarks that read byte-level texts through Conf-KV's teacher-forced reader run end to
end on the reference model: decode-eviction blocks and Fast KVzip's decode buffer."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv import bundled
from jaxkv.benchmarks import confkv_settings, decode_blocks, fastkvzip_decode
from jaxkv.benchmarks.teacher_forced import byte_rows
from jaxkv.gates import fastkvzip as fastkvzip_gate
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib

SETTINGS = dataclasses.replace(
    confkv_settings.QUICK, prefix=96, continuation=24, tight=24, loose=40, protected=8
)


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(0)
    heldout = corpus_lib.load_corpus("heldout")
    return [heldout.text(rng, SETTINGS.prefix + SETTINGS.continuation + 1) for _ in range(2)]


def test_byte_rows_open_with_the_bos():
    rows = byte_rows([b"ab", b"cd"])
    np.testing.assert_array_equal(rows, [[256, 97, 98], [256, 99, 100]])


def test_decode_blocks_compares_each_block_with_eviction_every_step(model, texts):
    summary = decode_blocks.run(model, texts, SETTINGS, blocks=(1, 8))
    assert set(summary) == {"full"} | {
        f"{name}/every-{n}" for name in ("h2o", "streaming_llm", "confkv") for n in (1, 8)
    }
    for key, row in summary.items():
        assert np.isfinite(row["bits_per_byte"])
        if key.endswith("every-1"):
            assert row["delta_vs_every_step"] == 0.0
    assert summary["full"]["tokens_per_head"] > summary["h2o/every-1"]["tokens_per_head"]


def test_fastkvzip_decode_matches_h2o_to_the_tokens_fast_kvzip_held(model, texts):
    gates = fastkvzip_gate.init_params(model.config, jax.random.PRNGKey(0))
    report = fastkvzip_decode.run(model, gates, texts, SETTINGS, ratio=0.3, log=lambda *a: None)
    results = report["policies"]
    assert set(results) == {"full", "fastkvzip", "h2o"}
    assert all("trace" not in result for result in results.values())
    assert results["h2o"]["tokens_per_head"] <= report["matched_tokens_per_head"] + 32
    assert results["fastkvzip"]["tokens_per_head"] < results["full"]["tokens_per_head"]
    assert "| fastkvzip |" in fastkvzip_decode.table(report)
