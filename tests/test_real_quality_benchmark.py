"""The real-model quality benchmark's episodes, scores and settings, on a tiny GGUF model."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from jaxkv import policies
from jaxkv.benchmarks import harness, needles, real_quality
from jaxkv.models import gguf_tokenizer, load_gguf
from tests import gguf_files


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    path = gguf_files.write_tiny_qwen2(tmp_path_factory.mktemp("gguf"))
    return load_gguf(path), gguf_tokenizer(path)


@pytest.mark.parametrize("task", needles.TASKS)
def test_episodes_hide_the_asked_number_once_within_the_length(model_and_tokenizer, task):
    tokenizer = model_and_tokenizer[1]
    for index in range(3):
        episode = needles.build_episode(tokenizer, task, 1024, index)
        assert len(episode.context_ids) + len(episode.question_ids) <= 1024
        context = tokenizer.decode(episode.context_ids, skip_special_tokens=False)
        question = tokenizer.decode(episode.question_ids, skip_special_tokens=False)
        asked = re.search(r"special magic number for (\w+) mentioned", question).group(1)
        hidden = re.findall(r"The special magic number for (\w+) is (\d+)\.", context)
        assert len(hidden) == (1 if task == "needle" else needles.MULTIKEY_KEYS)
        assert dict(hidden)[asked] == episode.answer and len(episode.answer) == 7
        assert len({name for name, _ in hidden}) == len(hidden)
        assert question.endswith(f"The special magic number for {asked} is")
    again = needles.build_episode(tokenizer, task, 1024, 0)
    assert again == needles.build_episode(tokenizer, task, 1024, 0)  # deterministic


def test_scores_and_intervals(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    assert needles.score(tokenizer, tokenizer.encode(" 4821937."), "4821937") == (True, 1.0)
    assert needles.score(tokenizer, tokenizer.encode(" 48219."), "4821937") == (False, 5 / 7)
    assert needles.score(tokenizer, tokenizer.encode(" 5821937"), "4821937") == (False, 0.0)
    assert needles.score(tokenizer, tokenizer.encode(" no"), "4821937") == (False, 0.0)
    # Wilson's interval for 8 of 16 (z = 1.96): 0.5 -+ 0.2316 (by hand).
    low, high = harness.wilson_interval(8, 16)
    assert low == pytest.approx(0.2800, abs=1e-4) and high == pytest.approx(0.7200, abs=1e-4)
    assert harness.wilson_interval(16, 16)[1] == 1.0


def test_full_cache_answers_the_same_in_both_settings(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    episodes = [needles.build_episode(tokenizer, "needle", 512, i) for i in range(3)]
    full = policies.get("full")
    aware = real_quality.run_cell(model, tokenizer, full, episodes, "aware")
    agnostic = real_quality.run_cell(model, tokenizer, full, episodes, "agnostic")
    for key in ("exact", "leading_digits", "samples", "episode_exact"):
        assert aware[key] == agnostic[key]
    assert len(aware["episode_exact"]) == 3
    assert sum(aware["episode_exact"]) / 3 == aware["exact"]
    snap = real_quality.run_cell(
        model, tokenizer, policies.get("snapkv", budget=0.25), episodes, "agnostic"
    )
    assert 0.2 < snap["kv_bytes_per_sequence"] / agnostic["kv_bytes_per_sequence"] < 0.35
    assert np.isfinite(snap["leading_digits"])


@pytest.mark.parametrize("setting", needles.SETTINGS)
def test_batches_of_episodes_answer_as_one_batch(model_and_tokenizer, setting, monkeypatch):
    """--batch: a cell run two episodes at a time (the last batch short) gives each episode the
    answer tokens of the cell run in one batch, in order, and holds the same bytes per sequence."""
    model, tokenizer = model_and_tokenizer
    answers = []  # the random model never says the number: score its tokens themselves

    def record(tokenizer, row, answer):
        answers.append(tuple(int(t) for t in row))
        return int(row[0]) % 2 == 0, float(np.mean(row)) / model.config.vocab_size

    monkeypatch.setattr(real_quality, "score", record)
    episodes = [needles.build_episode(tokenizer, "multikey", 512, i) for i in range(3)]
    snap = policies.get("snapkv", budget=0.25)
    whole = real_quality.run_cell(model, tokenizer, snap, episodes, setting)
    batched = real_quality.run_cell(model, tokenizer, snap, episodes, setting, batch_size=2)
    assert answers[3:] == answers[:3] and len(set(answers)) > 1
    for key in ("exact", "leading_digits", "samples", "episode_exact"):
        assert batched[key] == whole[key]
    assert batched["kv_bytes_per_sequence"] == pytest.approx(whole["kv_bytes_per_sequence"])


def test_render_writes_the_table_of_a_saved_report(tmp_path):
    cell = dict(length=2048, samples=16, leading_digits=0.5, exact_interval=[0.1, 0.6])
    cell.update(task="needle", setting="aware")
    rows = [
        dict(cell, policy=policy, budget=budget, exact=exact, kv_bytes_per_sequence=held)
        for policy, budget, exact, held in [
            ("full", None, 1.0, 100.0),
            ("snapkv", 0.3, 0.25, 30.0),
            ("snapkv", 0.1, 0.0625, 10.0),
            ("tova", 0.3, 0.5, 30.0),
        ]
    ]
    # A longer context run for one task and setting only: its row of panels is part empty.
    longer = dict(cell, length=4096, task="multikey", setting="agnostic")
    rows.append(dict(longer, policy="full", budget=None, exact=0.5, kv_bytes_per_sequence=200.0))
    report = tmp_path / "quality.json"
    report.write_text(json.dumps({"rows": rows}))
    real_quality.main(["--render", str(report)])
    table = (tmp_path / "quality.md").read_text()
    assert "| snapkv | 0.3 | 2048 | aware | 30% | 0.25 [0.10, 0.60] | 0.50 |" in table
    assert "| full | auto | 4096 | agnostic | 100% |  |  | 0.50 [0.10, 0.60] | 0.50 | 16 |" in table
    assert (tmp_path / "quality.png").stat().st_size > 0
    budgets = (tmp_path / "quality-budgets.md").read_text().splitlines()
    assert budgets[0] == (
        "| policy | context | setting | needle at 0.1 | needle at 0.3 | multikey at 0.1 | "
        "multikey at 0.3 | KV of full at 0.1 | KV of full at 0.3 |"
    )
    # One budget is no sweep: tova has no line; a task not run is "-".
    assert budgets[2:] == ["| snapkv | 2048 | aware | 0.06 | 0.25 | - | - | 10% | 30% |"]

    # kvpress's report beside it: the cells both ran, in episodes; no budget sweep, no table.
    reference = [
        dict(rows[1], exact=0.25, leading_digits=0.4),  # snapkv 0.3: the same 4/16
        dict(rows[3], exact=0.375),  # tova 0.3: 6/16 against 8/16
        dict(rows[3], policy="kvzip_scored_prefix"),  # no jaxkv policy of that name
        dict(rows[0], samples=13),  # other episodes: not compared
    ]
    (tmp_path / "kvpress").mkdir()
    kvpress_report = tmp_path / "kvpress" / "quality.json"
    kvpress_report.write_text(json.dumps({"rows": reference}))
    real_quality.main(["--render", str(kvpress_report), "--against", str(report)])
    assert (tmp_path / "kvpress" / "agreement.md").read_text().splitlines()[2:] == [
        "| snapkv | 0.3 | 2048 | needle | aware | 4/16 | 4/16 | 0 | 0.50 | 0.40 |",
        "| tova | 0.3 | 2048 | needle | aware | 8/16 | 6/16 | 2 | 0.50 | 0.50 |",
    ]
    assert not (tmp_path / "kvpress" / "quality-budgets.md").exists()
    # Two policies at a budget each: no policy is swept, so no table of sweeps.
    (tmp_path / "single").mkdir()
    single = tmp_path / "single" / "quality.json"
    single.write_text(json.dumps({"rows": [rows[0], rows[2], rows[3]]}))
    real_quality.main(["--render", str(single)])
    assert (tmp_path / "single" / "quality.md").exists()
    assert not (tmp_path / "single" / "quality-budgets.md").exists()
    with pytest.raises(ValueError, match="--render"):
        real_quality.main(["--against", str(report)])


def test_paired_ratio_interval_resamples_episodes_together():
    full = np.zeros(400, dtype=bool)
    full[:300] = True
    assert harness.paired_ratio_interval(full, full) == (1.0, 1.0)
    subset = full.copy()
    subset[270:300] = False  # 270 of the full cache's 300 answers: 0.9
    low, high = harness.paired_ratio_interval(subset, full)
    # The delta method by hand: d = x - 0.9 y is 0.1 on 270 episodes, -0.9 on 30, 0 on 100;
    # var(d) = (270 * 0.01 + 30 * 0.81) / 400 = 0.0675; se = sqrt(0.0675 / 400) / 0.75 = 0.01732.
    assert low == pytest.approx(0.9 - 1.96 * 0.01732, abs=0.006)
    assert high == pytest.approx(0.9 + 1.96 * 0.01732, abs=0.006)
    superset = full.copy()
    superset[300:310] = True
    assert harness.paired_ratio_interval(superset, full)[0] >= 1.0
    assert np.isnan(harness.paired_ratio_interval(full, np.zeros(400, dtype=bool))).all()
    with pytest.raises(ValueError, match="one outcome per episode"):
        harness.paired_ratio_interval(full, full[:10])


def test_paired_table_compares_each_policy_with_the_full_cache_episode_by_episode(tmp_path):
    cell = dict(length=2048, task="multikey", setting="agnostic", samples=4, leading_digits=0.5)
    outcomes = {"full": [1, 1, 1, 0], "kvzip": [1, 0, 1, 1], "snapkv": [0, 0, 0, 0]}
    rows = [
        dict(
            cell,
            policy=policy,
            budget=None if policy == "full" else 0.3,
            exact=sum(found) / 4,
            exact_interval=harness.wilson_interval(sum(found), 4),
            kv_bytes_per_sequence=100.0 if policy == "full" else 30.0,
            episode_exact=[bool(f) for f in found],
        )
        for policy, found in outcomes.items()
    ]
    rows.append(dict(rows[1], policy="tova", samples=3, episode_exact=[True] * 3))  # other episodes
    rows.append({k: v for k, v in rows[1].items() if k != "episode_exact"} | {"policy": "h2o"})
    report = tmp_path / "quality.json"
    report.write_text(json.dumps({"rows": rows}))
    real_quality.main(["--render", str(report)])
    lines = (tmp_path / "quality-paired.md").read_text().splitlines()
    kvzip_low, kvzip_high = harness.paired_ratio_interval(outcomes["kvzip"], outcomes["full"])
    assert lines[2:] == [
        "| kvzip | 0.3 | 2048 | multikey | agnostic | 30% | 3/4 | 3/4 | 2/3 | 1 | "
        f"1.00 [{kvzip_low:.2f}, {kvzip_high:.2f}] |",
        "| snapkv | 0.3 | 2048 | multikey | agnostic | 30% | 0/4 | 3/4 | 0/3 | 0 | "
        "0.00 [0.00, 0.00] |",
    ]
    # Without a full cache recording its episodes nothing pairs: no table of headers alone.
    unpaired = tmp_path / "unpaired"
    unpaired.mkdir()
    (unpaired / "quality.json").write_text(json.dumps({"rows": rows[1:]}))
    real_quality.main(["--render", str(unpaired / "quality.json")])
    assert (unpaired / "quality.md").exists()
    assert not (unpaired / "quality-paired.md").exists()


def test_learned_policies_run_with_their_saved_parameters(model_and_tokenizer, tmp_path, capsys):
    """--params NAME=PATH: the policy loads its parameters (its params part's load), the row names
    them, and a learned policy without them is refused before any model work."""
    from jaxkv.gates.wgkv import save_write_gates

    model, _ = model_and_tokenizer
    gguf = tmp_path / "tiny.gguf"
    gguf_files.write_gguf(gguf, gguf_files.random_model("qwen2-bias"), "qwen2", "F16", "qwen2")
    gates_dir = tmp_path / "lambda-x"
    gates_dir.mkdir()
    wgkv = policies.get("wgkv")
    save_write_gates(
        wgkv.params.init(model.config, jax.random.PRNGKey(0)), gates_dir / "g.safetensors"
    )
    common = ["--model", str(gguf), "--lengths", "512", "--samples", "2", "--out", str(tmp_path)]
    ships_none = r"--policies wgkv: jaxkv ships no trained parameters of wgkv for --model .*tiny"
    with pytest.raises(ValueError, match=ships_none):
        real_quality.main([*common, "--policies", "wgkv"])
    with pytest.raises(ValueError, match=r"--batch 0 must be >= 1"):
        real_quality.main([*common, "--policies", "full", "--batch", "0"])
    with pytest.raises(ValueError, match=r"--params snapkv=.*takes no parameters"):
        real_quality.main([*common, "--policies", "snapkv", "--params", f"snapkv={gates_dir}"])
    argv = [*common, "--policies", "wgkv", "--params", f"wgkv={gates_dir}", "--tasks", "needle"]
    rows = real_quality.main(argv)["rows"]
    assert {r["policy"] for r in rows} == {"wgkv[lambda-x]"} and len(rows) == 2
    assert {r["params"] for r in rows} == {str(gates_dir)}
    assert all(0 < r["kv_bytes_per_sequence"] for r in rows)
    capsys.readouterr()
    resumed = real_quality.main(argv)["rows"]  # nothing left to run, and it says so
    assert resumed == json.loads(json.dumps(rows))
    assert "2 of 2 cells are already in" in capsys.readouterr().out
    again = real_quality.main([*argv, "--recompute"])["rows"]
    assert len(again) == 2 and "already in" not in capsys.readouterr().out
    assert [r["episode_exact"] for r in again] == [r["episode_exact"] for r in rows]
    records_only = tmp_path / "records-only"  # a gates folder holding its training record only
    records_only.mkdir()
    (records_only / "training.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds neither gates.safetensors nor an orbax"):
        real_quality.main(
            [*common, "--policies", "fastkvzip", "--params", f"fastkvzip={records_only}"]
        )


def test_policy_entries_set_fields_and_name_their_rows(tmp_path):
    """--policies NAME:KEY=VALUE sets the policy's field (a narrower local window holds fewer
    bytes), the row is named by the entry; a budget, an unknown field or a bad value is refused
    before any model work."""
    gguf = tmp_path / "tiny.gguf"
    gguf_files.write_gguf(gguf, gguf_files.random_model("qwen2-bias"), "qwen2", "F16", "qwen2")
    common = ["--model", str(gguf), "--lengths", "512", "--samples", "2", "--tasks", "needle"]
    common += ["--settings", "agnostic", "--out", str(tmp_path)]
    for entry, message in [
        ("snapkv:0.3", r"--policies snapkv:0.3: after the name give KEY=VALUE"),
        ("snapkv:budget=0.3", r"budgets come from --budgets"),
        ("wgkv:taux=0.3", r"--policies wgkv:taux=0.3, option 'taux=0.3': .* fields of .*tau"),
        ("local_attention:window=many", r"window=many: expected int"),
        ("nope:tau=1", r"--policies nope:tau=1: registered policies are"),
    ]:
        with pytest.raises(ValueError, match=message):
            real_quality.main([*common, "--policies", entry])
    entries = ["local_attention", "local_attention:window=64"]
    rows = real_quality.main([*common, "--policies", *entries])["rows"]
    held = {r["policy"]: r["kv_bytes_per_sequence"] for r in rows}
    assert set(held) == set(entries)
    assert held["local_attention:window=64"] < held["local_attention"]
    assert real_quality.policy_label("wgkv:tau=0.3", tmp_path / "lambda-x") == (
        "wgkv[lambda-x]:tau=0.3"
    )


def test_kvpress_reference_saves_a_tokenizer_that_loads_unchanged(tmp_path):
    """KVzipPress loads the tokenizer from a directory: it must encode as the GGUF's does."""
    import transformers

    from jaxkv.benchmarks.kvpress_reference import saved_tokenizer_directory

    path = tmp_path / "llama.gguf"
    gguf_files.write_gguf(path, gguf_files.random_model("llama-gqa"), "llama", "F16", "default")
    original = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    saved = transformers.AutoTokenizer.from_pretrained(saved_tokenizer_directory(original))
    text = "\n\nRepeat the previous context exactly. The special magic number for Rosa is 1234567."
    assert saved.encode(text) == original.encode(text) == gguf_tokenizer(path).encode(text)
    messages = [{"role": "user", "content": text}]
    rendered = [
        t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for t in (saved, original)
    ]
    assert rendered[0] == rendered[1]


def test_kvpress_reference_reuse_arguments():
    """--reuse takes `jaxkv bench reuse`'s document and its own defaults; real_quality's episode
    options, several lengths and a press kvpress lacks are refused (no kvpress needed)."""
    from jaxkv.benchmarks.kvpress_reference import REUSE_PRESSES, parse_arguments

    args = parse_arguments(["--reuse"])
    assert (args.presses, args.questions, args.lengths) == (list(REUSE_PRESSES), 8, [2048])
    assert args.out.as_posix() == "results/reuse/kvpress" and args.budgets == [0.3]
    quality = parse_arguments([])
    assert quality.presses == ["full", "snapkv", "streaming_llm"] and quality.samples == 16
    assert quality.out.as_posix() == "results/real-quality/needles-2k/kvpress"
    assert quality.questions is None
    for argv, message in [
        (["--reuse", "--tasks", "needle"], "--tasks: an option real_quality's"),
        (["--reuse", "--replace"], "--replace: an option real_quality's"),
        (["--questions", "4"], "--questions: an option with --reuse only"),
        (["--reuse", "--lengths", "1024", "2048"], "--lengths: --reuse compresses one context"),
        (["--reuse", "--questions", "0"], "--questions 0: at least one"),
        (["--reuse", "--presses", "h2o"], "--presses h2o: kvpress presses here are"),
        (["--reuse", "--budgets", "1.5"], r"--budgets 1.5: a share"),
        (["--presses", "finch"], "--presses finch: --ruler only"),
    ]:
        with pytest.raises(SystemExit, match=message):
            parse_arguments(argv)


def test_kvpress_reference_checks_its_ruler_options(tmp_path):
    """FINCH scores with the question: the kvpress side refuses it in the agnostic setting, as
    jaxkv's runner does; a ratio, task or setting RULER's runner has not is refused by name."""
    from jaxkv.benchmarks.kvpress_reference import parse_arguments

    samples = tmp_path / "samples.jsonl"
    samples.write_text("")
    ruler = ["--ruler", str(samples)]
    args = parse_arguments([*ruler, "--presses", "full", "finch", "--settings", "aware"])
    assert args.settings == ["aware"] and args.ratios == [0.25, 0.5, 0.75, 0.875]
    for argv, message in [
        (["--presses", "finch"], "--presses finch: scores with the question"),
        (["--ratios", "1.0"], r"--ratios 1.0: the share evicted"),
        (["--settings", "awre"], "--settings awre: --ruler's are agnostic, aware"),
        (["--tasks", "qa_1"], "--tasks qa_1: --ruler's are niah_single_1"),
    ]:
        with pytest.raises(SystemExit, match=message):
            parse_arguments([*ruler, *argv])
