"""The quality benchmark's harness (fast mode) on the bundled reference model."""

import dataclasses
import json

import pytest

from jaxkv.benchmarks import byte_tasks, quality, teacher_forced
from jaxkv.models import byte_tokenizer


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    return quality.main(["--fast", "--out", str(out)]), out


def test_fast_sweep_covers_every_policy_and_task(report):
    result, out = report
    rows = result["rows"]
    sweep = quality.FAST
    assert len(rows) == len(sweep.policies) * len(sweep.tasks)
    assert json.loads((out / "quality.json").read_text())["rows"] == rows
    table = (out / "quality.md").read_text()
    assert all(f"| {name} |" in table for name in sweep.policies)
    header, _, *lines = table.splitlines()
    assert header.endswith("| samples |")
    assert all(line.endswith(f"| {sweep.samples} |") for line in lines)
    assert (out / "quality.png").stat().st_size > 10_000


def test_render_rewrites_the_table_and_plot_from_the_json(report, tmp_path):
    result, out = report
    saved = tmp_path / "quality.json"
    saved.write_text((out / "quality.json").read_text())
    assert quality.main(["--render", str(saved)])["rows"] == result["rows"]
    assert (tmp_path / "quality.md").read_text() == (out / "quality.md").read_text()
    assert (tmp_path / "quality.png").stat().st_size > 10_000


def test_full_cache_retrieves_and_compression_holds_less(report):
    rows = report[0]["rows"]

    def cell(policy, task):
        return next(r for r in rows if r["policy"] == policy and r["task"] == task)

    assert cell("full", "needle")["accuracy"] == 1.0
    assert cell("full", "multikey")["accuracy"] == 1.0
    full_bytes = cell("full", "needle")["kv_bytes_per_sequence"]
    for name in ("streaming_llm", "sliding_window"):
        held = cell(name, "needle")["kv_bytes_per_sequence"]
        assert 0.4 * full_bytes <= held <= 0.6 * full_bytes  # budget 0.5, page-rounded
    assert 0.2 < cell("full", "bpb")["bits_per_byte"] < 2.0
    assert cell("sliding_window", "bpb")["bits_per_byte"] >= cell("full", "bpb")["bits_per_byte"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--policies", "nope"], "policy='nope'"),
        (["--budgets", "0"], "budget=0.0"),
        (["--budgets", "1.5"], "budget=1.5"),
        (["--lengths", "100"], "length=100"),
        (["--tasks", "poetry"], "task='poetry'"),
    ],
)
def test_bad_sweep_arguments(argv, message):
    with pytest.raises(ValueError, match=message):
        quality.main(["--fast", *argv])


def test_the_default_sweep_runs_the_bundled_gates_and_names_missing_parameters():
    """The default sweep runs WG-KV and Fast KVzip on the gates jaxkv ships for the reference
    model (`LearnedParams.shipped_path`); duo_attention ships none and is named when asked for
    without --params."""
    assert {"fastkvzip", "wgkv"} <= set(quality.FULL.policies)
    assert "duo_attention" not in quality.FULL.policies
    quality.check_sweep(quality.FULL)
    with_duo = dataclasses.replace(quality.FULL, policies=("duo_attention", "fastkvzip"))
    with pytest.raises(ValueError, match="policy='duo_attention' needs policy_params: --params"):
        quality.check_sweep(with_duo)
    quality.check_sweep(with_duo, {"duo_attention": None})


@pytest.mark.parametrize(
    "pair,message",
    [
        ("fastkvzip=/nowhere.safetensors", "--params fastkvzip=/nowhere.safetensors: no such"),
        ("snapkv=/tmp", "--params snapkv=/tmp: policy 'snapkv' takes no parameters"),
        ("nothing", "--params nothing: give NAME=PATH"),
    ],
)
def test_bad_params_are_named(pair, message):
    with pytest.raises(ValueError, match=message):
        quality.main(["--policies", "fastkvzip", "--params", pair])


def test_the_byte_tasks_ids_are_the_byte_tokenizer_s():
    """The byte-level benchmarks' BOS/EOS/PAD (byte_tasks, teacher_forced) are the reference
    model's tokenizer's."""
    tokenizer = byte_tokenizer()
    ids = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    assert (byte_tasks.BOS, byte_tasks.EOS, byte_tasks.PAD) == ids
    assert teacher_forced.BOS == tokenizer.bos_id
