"""The Conf-KV benchmark's teacher-forced reader runs the policy's decode hook as `generate`;
its texts are the model's own tokens (byte-level held-out code, or prose for a real tokenizer)."""

import dataclasses

import numpy as np
import pytest

from jaxkv import bundled, policies
from jaxkv.benchmarks import confkv as bench
from jaxkv.benchmarks.confkv_settings import QUICK, Settings
from jaxkv.benchmarks.teacher_forced import Reading, rng_for, teacher_forced
from jaxkv.models import byte_tokenizer, gguf_tokenizer, load_hf_checkpoint
from jaxkv.prose import prose
from jaxkv.train import corpus as corpus_lib
from tests import gguf_files


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


@pytest.fixture(scope="module")
def reading():
    return Reading(byte_tokenizer(), "heldout")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """A tiny model file with a tokenizer of its own (not byte-level)."""
    return gguf_files.write_tiny_qwen2(tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("evict_every", [1, 8])
def test_teacher_forced_read_holds_the_budget_on_due_steps(model, evict_every):
    text = b"def area(width, height):\n    return width * height\n\n" * 4
    settings = Settings(prefix=96, continuation=48, bins=2)
    policy = policies.ConfKV(tight=24, loose=40, protected=8, evict_every=evict_every)
    rows = np.array([[256, *text]], np.int32)
    result = teacher_forced(model, policy, rows, 97, settings.continuation, settings.bins)
    held = np.asarray(result["trace"]["tokens_per_head"])
    assert np.isfinite(result["bits_per_token"])
    assert len(held) == 48
    assert held.max() <= 40 + evict_every
    due = np.arange(1, len(held) + 1) % evict_every == 0
    assert np.all(held[due] <= 40)
    assert held.min() >= 24


def test_gap_closed_share_and_interval():
    full = [1.0, 2.0, 1.5]
    window = [2.0, 3.0, 2.5]  # gap 1 on every text
    policy = [1.5, 2.75, 1.75]  # closes 0.5, 0.25, 0.75
    closed = bench.gap_closed(full, window, policy, np.random.default_rng(0), resamples=500)
    assert closed["share"] == pytest.approx(0.5)
    assert closed["per_text"] == pytest.approx([0.5, 0.25, 0.75])
    low, high = closed["interval_90"]
    assert 0.25 <= low < 0.5 < high <= 0.75
    assert closed["texts"] == 3


def test_ablation_rows_change_one_thing_each():
    s = Settings()
    rows = bench.ablation_rows(s)
    base = rows["default"]
    assert (base.per_head, base.evict_every, base.alpha) == (False, 32, 0.5)
    assert rows["per_head"] == dataclasses.replace(base, per_head=True)
    assert rows["fixed_budget"].tight == rows["fixed_budget"].loose == s.tight
    assert (rows["budgets_x2"].tight, rows["budgets_x2"].loose) == (2 * s.tight, 2 * s.loose)


def test_teacher_forced_refuses_rows_too_short_for_the_read(model):
    rows = np.zeros((1, 100), np.int32)
    with pytest.raises(ValueError, match="rows of 100 tokens: need 101"):
        teacher_forced(model, policies.FullCache(), rows, 52, continuation=48)


def test_heldout_rows_are_the_bos_and_the_corpus_bytes(reading):
    rows = reading.rows("ppl", 3, 40)
    assert rows.shape == (3, 41) and rows.dtype == np.int32
    assert np.all(rows[:, 0] == 256)
    data = corpus_lib.load_corpus("heldout").data.tobytes()
    for row in rows:
        assert bytes(row[1:].astype(np.uint8).tolist()) in data
    np.testing.assert_array_equal(rows, reading.rows("ppl", 3, 40))  # the same for every policy
    assert not np.array_equal(rows, reading.rows("kl", 3, 40))  # each task its own texts


def test_prose_rows_are_the_models_own_ids_of_python_docs(gguf_path):
    tokenizer = gguf_tokenizer(gguf_path)
    reading = Reading(tokenizer, "prose")
    rows = reading.rows("ppl", 2, 300)
    assert rows.shape == (2, len(tokenizer.encode("")) + 300)
    seeds = rng_for("ppl").integers(0, 2**31, 2)
    for row, seed in zip(rows, seeds, strict=True):
        expected = tokenizer.encode(prose(20_000, seed=int(seed)), add_bos=False)[:300]
        np.testing.assert_array_equal(row[len(reading.opening) :], expected)
    with pytest.raises(ValueError, match="text='web'"):
        Reading(tokenizer, "web")


def test_needles_are_refused_for_a_model_with_its_own_tokenizer(gguf_path, tmp_path):
    with pytest.raises(SystemExit, match="the needle part is byte-level"):
        bench.main(["--model", str(gguf_path), "--parts", "ppl,needle", "--out", str(tmp_path)])


def test_tiny_ablation_matches_the_window_to_confkv_memory(model, reading):
    s = dataclasses.replace(
        QUICK, prefix=96, tight=24, loose=40, protected=8, ablation_continuation=12
    )
    out = bench.run_ablation(model, reading, s, ["default", "evict_every_1"], log=print)
    assert (out["texts"], out["continuation"]) == (2, 12)
    for row in out["rows"].values():
        held = row["confkv"]["tokens_per_head"]
        assert row["window_tokens"] == round(held)
        assert row["window"]["tokens_per_head"] == row["window_tokens"]  # every step, exactly
        assert len(row["confkv"]["bits_per_token_per_text"]) == 2
        assert set(row["gap_closed"]) == {"share", "interval_90", "per_text", "texts"}
    with pytest.raises(ValueError, match="unknown ablation rows"):
        bench.run_ablation(model, reading, s, ["nope"])


def test_ppl_settings_no_policy_accepts_fail_before_any_reading(model, reading):
    # The pyramid's smallest layer budget is tight x 0.5 = 8, not above protected = 8.
    s = dataclasses.replace(QUICK, tight=16, loose=32, protected=8)
    logged = []
    with pytest.raises(ValueError, match="protected=8 must be smaller"):
        bench.run_ppl(model, reading, s, log=lambda *args: logged.append(args))
    assert logged == []
