"""RULER's synthetic tasks (`benchmarks/ruler_tasks.py`), its runner (`jaxkv bench ruler`) and the
shared-context suite's contexts and runner (`jaxkv bench ruler_shared`), on the bundled
byte-level reference model."""

from __future__ import annotations

import collections
import csv
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from jaxkv import bundled, policies
from jaxkv.benchmarks import (
    harness,
    kvpress_reference,
    read_groups,
    ruler,
    ruler_report,
    ruler_shared,
    ruler_tasks,
    score_ties,
    shared_context_tasks,
    wgkv_calibration,
)
from jaxkv.model_sources import load_model, stop_tokens
from jaxkv.models import Family, init_model, load_tokenizer
from tests.tiny_models import tiny_config


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled.REFERENCE_MODEL)


def test_versus_kvpress_is_jaxkv_minus_kvpress_over_the_samples_both_ran():
    def record(policy, task, index, score, prediction, ratio=0.5):
        return {"task": task, "index": index, "policy": policy, "ratio": ratio} | {
            "setting": "agnostic",
            "score": score,
            "prediction": prediction,
        }

    (as_kvpress,) = ruler_report.KVPRESS_VARIANTS.values()  # jaxkv's entry for the variant
    ours = [
        record("knorm", "vt", 0, 1.0, "a"),
        record("knorm", "vt", 1, 0.0, "b"),
        record("knorm", "cwe", 0, 0.5, "c"),
        record("knorm", "cwe", 1, 1.0, "only jaxkv ran it"),
        record("full", "vt", 0, 1.0, "x", ratio=0.0),
        record("kvzip", "vt", 0, 0.0, "k"),
        record(as_kvpress, "vt", 0, 0.0, "k"),
    ]
    theirs = [
        record("knorm", "vt", 0, 0.0, "z"),
        record("knorm", "vt", 1, 0.0, "b"),
        record("knorm", "cwe", 0, 0.5, "c "),
        record("full", "vt", 0, 1.0, "x", ratio=0.0),
        record("kvzip", "vt", 0, 0.0, "k"),
        record("kvzip_scored_prefix", "vt", 0, 1.0, "kv"),  # set against jaxkv's kvzip
        record("kvzip_scored_prefix", "vt", 1, 1.0, "no jaxkv record"),
    ]
    table = ruler_report.versus_kvpress(ours, theirs, ["vt", "cwe"])
    summary = table.split("Full cache:")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in summary.splitlines()}
    # vt: (1 + 0) / 2 - 0 = +50; cwe: +0 on the one sample both ran; 2 of 3 predictions equal
    assert rows["knorm"].endswith("| +50.0 | +0.0 | +25.0 | 3 | 2 |")
    assert rows["full"].endswith("| +0.0 |  | +0.0 | 1 | 1 |")
    assert rows["kvzip"].endswith("| +0.0 |  | +0.0 | 1 | 1 |")
    assert rows[f"{as_kvpress} vs kvzip_scored_prefix"].endswith("| -100.0 |  | -100.0 | 1 | 0 |")
    assert "Full cache: 1/1 predictions identical." in table
    differing = table.split("Predictions that differ:")[1]
    assert '| knorm | 0.5 | agnostic | vt | 0 | "a" | "z" | 1.00 / 0.00 |' in differing
    assert differing.count("| knorm |") == 1  # "c" and "c " agree; "only jaxkv ran it" is alone
    assert f'| {as_kvpress} vs kvzip_scored_prefix | 0.5 | agnostic | vt | 0 | "k" | "kv" |' in (
        differing
    )


def test_cells_follow_the_records_a_dropped_cell_removed(tmp_path):
    run = {"length": 4096, "model_name": "m", "provenance": {"command": "c"}}
    record = {"task": "vt", "index": 0, "prediction": "x", "outputs": ["x"], "score": 1.0}
    records = [{**record, "policy": p, "ratio": 0.5, "setting": "agnostic"} for p in "ab"]
    ruler_report.write_cells(records, tmp_path, "ruler", run)
    assert len(list((tmp_path / "cells").iterdir())) == 2
    ruler_report.write_cells(records[:1], tmp_path, "ruler", run)
    (cell,) = (tmp_path / "cells").iterdir()
    assert cell.name == ruler_report.cell_name("ruler", 4096, "m", "a", 0.5, "agnostic")
    assert json.loads((cell / "metrics.json").read_text())["vt"] == {"string_match": 100.0}


def test_a_cell_with_fewer_samples_of_a_task_than_another_cell_is_still_running():
    def record(policy, task, index):
        return {"task": task, "index": index, "policy": policy, "ratio": 0.5} | {
            "setting": "agnostic",
            "score": 1.0,
            "kv_bytes": 1.0,
        }

    records = [record(p, t, i) for p in ("full", "a") for t in ("vt", "cwe") for i in (0, 1)]
    rows = ruler_report.leaderboard(records[:-1], ["vt", "cwe"])  # a lacks cwe's sample 1
    expected = ruler_report.expected_samples(rows)
    assert expected == {"vt": 2, "cwe": 2}
    assert [r["samples"] == expected for r in rows] == [True, False]


def test_the_plot_joins_only_finished_cells():
    def row(policy, ratio, samples, average):
        return {"policy": policy, "setting": "agnostic", "compression_ratio": ratio} | {
            "samples": {"vt": samples},
            "average": average,
        }

    rows = [row("full", 0.0, 2, 9.0), row("a", 0.75, 2, 3.0), row("a", 0.25, 2, 5.0)]
    rows += [row("a", 0.5, 1, 0.0), row("b", 0.5, 1, 7.0), row("c", 0.5, 2, 1.0)]
    rows += [row("a", 0.5, 2, 4.0) | {"setting": "aware"}]
    points = ruler_report.policy_points(rows, "agnostic", {"vt": 2})
    assert points == {
        "a": ([(0.25, 5.0), (0.75, 3.0)], [(0.5, 0.0)]),
        "b": ([], [(0.5, 7.0)]),
        "c": ([(0.5, 1.0)], []),
    }


@pytest.mark.parametrize(
    "entry, message",
    [
        ("snapkv:window=8", None),
        ("nonesuch", "--policies nonesuch: registered are"),
        ("gvote", "--policies gvote: takes no budget, so no compression ratio"),
    ],
)
def test_ratio_sweeps_take_registered_policies_with_a_budget(entry, message):
    if message is None:
        assert harness.parse_ratio_policies([entry]) == {entry: ("snapkv", {"window": 8})}
        return
    with pytest.raises(SystemExit, match=message):
        harness.parse_ratio_policies([entry])


def test_the_committed_sweep_script_runs_the_issues_cells_with_valid_commands():
    env = {**os.environ, "KVPRESS_PYTHON": "kvpress-python"}
    script = Path(ruler.__file__).resolve().parent / "ruler_sweeps.sh"
    shown = subprocess.run(
        ["bash", str(script), "--dry-run"], env=env, capture_output=True, text=True, check=True
    )
    ran = collections.defaultdict(set)  # (setting, ratio) -> policies
    for line in shown.stdout.splitlines():
        module, argv = line.split(" -m jaxkv.benchmarks.")[1].split(" ", 1)
        argv = argv.split()
        if module == "ruler":
            args = ruler.parse_arguments(argv)
            names = [name for name, _ in harness.parse_ratio_policies(args.policies).values()]
        else:
            assert module == "kvpress_reference"
            args = kvpress_reference.parse_arguments(argv)
            names = [f"kvpress:{name}" for name in args.presses]
        for setting in args.settings:
            for ratio in args.ratios:
                ran[(setting, ratio)].update(names)
    issue = {"full", "kvzip", "fastkvzip", "wgkv", "snapkv", "pyramidkv", "expected_attention"}
    issue |= {"tova", "streaming_llm", "knorm", "adakv"}
    for ratio in (0.25, 0.5, 0.75, 0.875):
        assert issue <= ran[("agnostic", ratio)]
        assert {"snapkv", "adakv", "finch", "chunkkv"} <= ran[("aware", ratio)]
    assert {"kvpress:finch", "kvpress:adakv", "kvpress:chunkkv"} <= ran[("aware", 0.5)]
    assert {"kvpress:kvzip", "kvpress:pyramidkv", "kvpress:kvzip_scored_prefix"} <= ran[
        ("agnostic", 0.5)
    ]


def test_string_match_all_is_rulers_share_of_references_found():
    refs = ["4821937", "1111111", "UUID-abc"]
    assert ruler_tasks.string_match_all("They are 4821937 and uuid-ABC.", refs) == 2 / 3
    assert ruler_tasks.string_match_all("nothing here", refs) == 0.0
    assert ruler_tasks.string_match_all("4821937, 1111111, uuid-abc", refs) == 1.0
    # substring match, as RULER's `r.lower() in pred.lower()`: a longer number contains it
    assert ruler_tasks.string_match_all("48219370", ["4821937"]) == 1.0
    assert ruler_tasks.postprocess("  A\x00B\tC \n") == "A\nB\nC"


def test_a_prediction_ends_at_the_first_stop_token(tokenizer):
    ids = tokenizer.encode("Paris. ", add_bos=False)
    stop = {0}
    rome = tokenizer.encode("Rome", add_bos=False)
    assert ruler_tasks.prediction(tokenizer, [*ids, 0, *rome], stop) == "Paris."


@pytest.mark.parametrize("task", ruler_tasks.TASKS)
def test_samples_fit_hold_their_answers_and_repeat_from_the_seed(tokenizer, task):
    length = 2048
    sample = ruler_tasks.build_sample(tokenizer, task, length, 0)
    assert sample == ruler_tasks.build_sample(tokenizer, task, length, 0)
    assert sample != ruler_tasks.build_sample(tokenizer, task, length, 1)
    assert ruler_tasks.build_sample(tokenizer, task, length, 0, seed=1) != sample
    assert 0.85 * length < sample.num_tokens <= length  # the largest haystack that fits
    context = tokenizer.decode(sample.context_ids)
    assert context == sample.context and all(o in context for o in sample.outputs)
    question = tokenizer.decode(sample.question_ids)
    assert question.endswith(sample.answer_prefix)
    assert not any(o in question for o in sample.outputs)
    # The aware setting compresses the context and the question, then reads the rest.
    compressed, after = sample.split("aware")
    assert tokenizer.decode(compressed) == sample.context + sample.question
    assert tokenizer.decode(after).endswith(sample.answer_prefix) and sample.answer_prefix
    assert sample.split("agnostic") == (
        list(sample.context_ids),
        list(sample.question_ids),
    )
    family = ruler_tasks.family(task)
    assert sample.max_new_tokens == ruler_tasks.ANSWER_TOKENS[family]
    assert ruler_tasks.sample_from_json(json.loads(json.dumps(sample.to_json()))) == sample
    if family == "niah":
        spec = ruler_tasks.NIAH[task]
        assert len(sample.outputs) == spec.num_values * spec.num_queries
        for value in sample.outputs:
            assert re.search(
                rf"One of the special magic {spec.values} for \S+ is: {value}\.", context
            )
    if task == "vt":  # the chain's first variable holds the number, each next one the last
        names = sample.outputs
        value = re.search(rf"VAR {names[0]} = (\d+)", context).group(1)
        assert f"value {value}" in sample.question
        for a, b in zip(names, names[1:], strict=False):
            assert f"VAR {b} = VAR {a}" in context
    if task in ("cwe", "fwe"):
        listed = sample.context.rsplit("\n", 1)[-1] if task == "cwe" else sample.context
        counts = collections.Counter(re.findall(r"[a-z]+|\.\.\.", listed))
        top = [w for w, _ in counts.most_common(len(sample.outputs) + 1) if w != "..."]
        assert set(top[: len(sample.outputs)]) == set(sample.outputs)


def test_shared_contexts_hold_every_answer_and_rotate_the_kinds(tokenizer):
    contexts = [shared_context_tasks.build_shared_context(tokenizer, 1536, c, 6) for c in range(2)]
    for context in contexts:
        text = tokenizer.decode(context.context_ids)
        assert all(o in text for outputs in context.outputs for o in outputs)
        assert len(context.context_ids) + max(map(len, context.questions)) <= 1536
    assert contexts[1].kinds == contexts[0].kinds[1:] + shared_context_tasks.QUESTION_KINDS[6:7]
    assert shared_context_tasks.build_shared_context(tokenizer, 1536, 0, 6) == contexts[0]


def test_shared_runner_asks_each_context_once_per_cell_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "shared"
    argv = ["--model", str(bundled.REFERENCE_MODEL), "--length", "1536", "--contexts", "1"]
    argv += ["--questions", "4", "--policies", "full", "snapkv", "knorm", "random"]
    argv += ["h2o:evict_every=8"]
    argv += ["--ratios", "0.5", "--out", str(out)]
    reads, ask_cells = [], ruler_shared.ask_cells
    monkeypatch.setattr(
        ruler_shared, "ask_cells", lambda *args: reads.append(len(args[-1])) or ask_cells(*args)
    )
    ruler_shared.main(argv)
    assert sorted(reads) == [1, 3]  # SnapKV, Knorm and Random from one read; the full cache
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 1 * 4  # full, SnapKV, Knorm, Random; H2O evicts while decoding
    assert {(r["policy"], r["ratio"]) for r in records} == {
        ("full", 0.0),
        ("snapkv", 0.5),
        ("knorm", 0.5),
        ("random", 0.5),
    }
    for r in records:  # a context's questions share its pages: held once, rows on top
        assert r["kv_bytes"] < r["total_bytes"] < r["separate_bytes"]
    run = json.loads((out / "run.json").read_text())
    assert len(run["skipped"]) == 1 and run["skipped"][0].startswith("h2o:evict_every=8: ")
    rows = {r["policy"]: r for r in json.loads((out / "shared.json").read_text())["rows"]}
    assert 0.4 < rows["snapkv"]["kept_share"] < 0.6 and rows["full"]["kept_share"] == 1.0
    assert list(rows["full"]["positions"]) == ["0", "1", "2", "3"]
    kinds = {r["task"] for r in records}
    assert set(rows["snapkv"]["kinds"]) == kinds <= set(shared_context_tasks.QUESTION_KINDS)
    snap = [r for r in records if r["policy"] == "snapkv"]
    assert rows["snapkv"]["average"] == pytest.approx(100 * sum(r["score"] for r in snap) / 4)

    # Compressed from one read of the context, SnapKV's and Random's answers and bytes are
    # those of the context prefilled under each alone (Random's draws from the same key).
    model, tokenizer = load_model(str(bundled.REFERENCE_MODEL))
    context = shared_context_tasks.build_shared_context(tokenizer, 1536, 0, 4)
    stop = stop_tokens(tokenizer, model.config)
    for name in ("snapkv", "random"):
        policy = policies.from_spec(f"{name}:0.5").for_tokenizer(tokenizer)
        (alone,) = ruler_shared.ask_cells(model, tokenizer, context, stop, [(policy, None)])
        assert [(r["prediction"], r["kv_bytes"]) for r in alone] == [
            (r["prediction"], r["kv_bytes"]) for r in records if r["policy"] == name
        ]

    # A context with a question's record missing (a run cut while writing them) is asked again.
    lines = (out / "records.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if json.loads(line)["policy"] == "knorm")
    (out / "records.jsonl").write_text("\n".join(lines[:cut] + lines[cut + 1 :]) + "\n")
    reads.clear()
    ruler_shared.main(argv)
    assert reads == [1] and len(ruler_report.load_records(out / "records.jsonl")) == 16
    with pytest.raises(SystemExit, match="--questions: .* holds a run with questions 4"):
        ruler_shared.main([*argv, "--questions", "5"])

    def never(*args, **kwargs):
        raise AssertionError("a finished context was asked again")

    monkeypatch.setattr(ruler_shared, "ask_cells", never)
    ruler_shared.main([*argv[: argv.index("random")], "--ratios", "0.5", "--out", str(out)])
    commands = json.loads((out / "run.json").read_text())["commands"]
    assert len(commands) == 2 and len(set(commands)) == 2


def test_runner_writes_the_leaderboard_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "ruler"
    argv = ["--model", str(bundled.REFERENCE_MODEL), "--length", "768"]
    argv += ["--tasks", "niah_single_1", "niah_multikey_2", "--samples", "1"]
    argv += ["--policies", "full", "snapkv", "--ratios", "0.5", "--max-new-tokens", "6"]
    argv += ["--out", str(out)]
    ruler.main(argv)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    cells = {(r["policy"], r["ratio"], r["setting"]) for r in records}
    assert cells == {
        ("full", 0.0, "agnostic"),
        ("snapkv", 0.5, "agnostic"),
        ("snapkv", 0.5, "aware"),
    }
    assert len(records) == 3 * 2 * 1
    assert all(0.0 <= r["score"] <= 1.0 and r["prompt_tokens"] <= 768 for r in records)
    for r in records:  # aware: the context and the question compressed, the rest read after
        turn = r["compressed_tokens"] - r["context_tokens"]
        after = r["prompt_tokens"] - r["context_tokens"]
        assert turn == 0 if r["setting"] == "agnostic" else 0 < turn < after
    board = list(csv.DictReader((out / "leaderboard.csv").open()))
    assert [(b["policy"], b["setting"]) for b in board][0] == ("full", "agnostic")
    report = json.loads((out / "leaderboard.json").read_text())
    assert report["provenance"]["command"].startswith("jaxkv bench ruler --model")
    snap = next(r for r in report["rows"] if r["policy"] == "snapkv" and r["setting"] == "agnostic")
    assert 0.4 < snap["kept_share"] < 0.6
    aware = next(r for r in report["rows"] if r["policy"] == "snapkv" and r["setting"] == "aware")
    assert 0.4 < aware["kept_share"] < 0.6  # of the full cache of what it compressed
    cell = out / "cells" / "ruler__768__reference-model__snapkv__0.50__query_aware"
    metrics = json.loads((cell / "metrics.json").read_text())
    assert metrics.pop("provenance")["command"].startswith("jaxkv bench ruler --model")
    assert set(metrics) == {"niah_single_1", "niah_multikey_2"}
    assert (out / "ruler.png").exists() and len(
        (out / "samples.jsonl").read_text().splitlines()
    ) == 2

    def never(*args, **kwargs):
        raise AssertionError("a finished sample was run again")

    monkeypatch.setattr(ruler, "answer", never)
    ruler.main(argv)  # every key is in records.jsonl: nothing runs
    assert len((out / "records.jsonl").read_text().splitlines()) == 6
    run = json.loads((out / "run.json").read_text())  # the resumed command listed once
    assert run["commands"] == ["jaxkv bench ruler " + " ".join(argv)]
    with pytest.raises(SystemExit, match=r"--seed: .* holds a run with seed 42"):
        ruler.main([*argv, "--seed", "7"])  # its records would be skipped as this seed's

    # A run killed while writing its last record: that one runs again, on a line of its own.
    monkeypatch.undo()
    text = (out / "records.jsonl").read_text()
    (out / "records.jsonl").write_text(text[: text.rindex("\n", 0, -1) + 40])
    ruler.main(argv)
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 7 and json.loads(lines[-1]) == records[-1] | {
        "seconds": json.loads(lines[-1])["seconds"]
    }

    # Both ratios of both policies of a sample from one read of its context (agnostic), both
    # ratios of SnapKV (the aware policy here) from one read of the prompt (aware): SnapKV 0.5's
    # answers and bytes are the run above's, one sample at a time.
    shared_out = tmp_path / "shared"
    shared_argv = [*argv[: argv.index("--policies")], "--policies", "snapkv", "knorm"]
    shared_argv += ["--ratios", "0.5", "0.75", "--max-new-tokens", "6"]
    ruler.main([*shared_argv, "--out", str(shared_out)])
    shared = [json.loads(line) for line in (shared_out / "records.jsonl").read_text().splitlines()]
    assert len(shared) == 2 * 4 + 2 * 2
    assert {(r["setting"], r["prefill_shared_by"]) for r in shared} == {
        ("agnostic", 4),
        ("aware", 2),
    }
    # One ratio's rows decode together: SnapKV's and Knorm's (agnostic), SnapKV's alone (aware).
    assert {(r["setting"], r["decoded_with"]) for r in shared} == {("agnostic", 2), ("aware", 1)}

    def answers(rows, ratio):
        return {
            (r["setting"], r["task"], r["index"]): (r["prediction"], r["kv_bytes"])
            for r in rows
            if (r["policy"], r["ratio"]) == ("snapkv", ratio)
        }

    assert answers(shared, 0.5) == answers(records, 0.5)
    monkeypatch.setattr(ruler, "answers_each", never)
    ruler.main([*shared_argv, "--out", str(shared_out)])  # grouped jobs resume too
    for setting in ("agnostic", "aware"):
        held = {
            r["ratio"]: r["kv_bytes"]
            for r in shared
            if (r["task"], r["index"], r["setting"]) == ("niah_single_1", 0, setting)
        }
        assert held[0.75] < held[0.5]


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_3", "niah_multivalue"])
def test_an_answer_s_token_span_spells_it_and_nothing_more(tokenizer, task):
    sample = ruler_tasks.build_sample(tokenizer, task, 768, 0)
    ids = list(sample.context_ids)
    for output in sample.outputs:
        span = ruler_tasks.answer_token_span(tokenizer, sample, output)
        assert tokenizer.decode(ids[span.start : span.stop]) == output
        assert output not in tokenizer.decode(ids[span.start + 1 : span.stop])
        assert output not in tokenizer.decode(ids[span.start : span.stop - 1])


def test_an_answer_held_more_than_once_has_no_span(tokenizer):
    sample = ruler_tasks.build_sample(tokenizer, "fwe", 768, 0)  # its words recur
    with pytest.raises(ValueError, match="not once"):
        ruler_tasks.answer_token_span(tokenizer, sample, sample.outputs[0])


def test_kept_says_which_pairs_keep_each_answer_token(tmp_path):
    argv = ["--model", str(bundled.REFERENCE_MODEL), "--length", "768", "--out", str(tmp_path)]
    argv += ["--policies", "full", "snapkv", "--ratios", "0.5", "--settings", "agnostic"]
    argv += ["--max-new-tokens", "6"]
    with pytest.raises(SystemExit, match="--kept niah_single_1: TASK:INDEX"):
        ruler.main([*argv, "--kept", "niah_single_1"])
    ruler.main([*argv, "--kept", "niah_single_1:0"])
    report = json.loads((tmp_path / "kept-niah_single_1-0.json").read_text())
    full, snapkv = report["rows"]
    model = load_model(str(bundled.REFERENCE_MODEL))[0]
    layers = model.config.num_layers
    assert full["pairs"] == snapkv["pairs"] == layers * model.config.num_kv_heads
    (answer,) = full["answers"]
    assert answer["kept_by"] == [full["pairs"]] * len(answer["positions"])
    assert answer["whole_in_layers"] == list(range(layers))
    assert snapkv["kv_bytes"] < full["kv_bytes"]
    assert full["ties"] is None and isinstance(snapkv["ties"], list)  # the full cache ranks none
    for row in (full, snapkv):  # greedy: each step's token the argmax, within the 6 asked
        assert 1 <= len(row["greedy"]) <= 6
        assert all(step["logit"] >= step["runner_up_logit"] for step in row["greedy"])
    assert "| snapkv | 0.5 | agnostic |" in (tmp_path / "kept-niah_single_1-0.md").read_text()
    assert not (tmp_path / "records.jsonl").exists()  # it runs nothing else
    # Another command's cells join the report; a cell run again replaces its row.
    again = [a if a != "full" else "knorm" for a in argv]
    ruler.main([*again, "--kept", "niah_single_1:0"])
    merged = json.loads((tmp_path / "kept-niah_single_1-0.json").read_text())
    assert [row["policy"] for row in merged["rows"]] == ["full", "knorm", "snapkv"]
    assert merged["rows"][0] == full and len(merged["commands"]) == 2
    # fwe's answers recur in its context: no span, the greedy answer all the same
    ruler.main([*argv[:6], "--policies", "full", "--max-new-tokens", "6", "--kept", "fwe:0"])
    (row,) = json.loads((tmp_path / "kept-fwe-0.json").read_text())["rows"]
    assert all("not once" in answer["no_span"] for answer in row["answers"])
    assert row["greedy"] and "(not held once)" in (tmp_path / "kept-fwe-0.md").read_text()


def test_a_sample_s_jobs_of_policies_that_read_alike_run_together_in_each_setting():
    jobs = [  # run order: setting, ratio, policy
        ("snapkv", 0.5, "agnostic", "vt", 0),
        ("knorm", 0.5, "agnostic", "vt", 0),
        ("wgkv", 0.5, "agnostic", "vt", 0),
        ("h2o", 0.5, "agnostic", "vt", 0),
        ("snapkv", 0.75, "agnostic", "vt", 0),
        ("knorm", 0.75, "agnostic", "vt", 0),
        ("snapkv", 0.75, "agnostic", "vt", 1),
        ("wgkv", 0.75, "agnostic", "vt", 0),
        ("snapkv", 0.5, "aware", "vt", 0),
        ("snapkv", 0.75, "aware", "vt", 0),
    ]
    groups = read_groups.job_groups(jobs, {"snapkv": 0, "knorm": 0, "h2o": 1})
    assert groups == [
        [jobs[0], jobs[4], jobs[1], jobs[5]],  # an entry's ratios side by side
        [jobs[2]],
        [jobs[3]],
        [jobs[6]],
        [jobs[7]],
        [jobs[8], jobs[9]],
    ]
    assert read_groups.reads_once("snapkv", {}) and read_groups.reads_once("kvzip", {})
    assert not any(read_groups.reads_once(name, {}) for name in ("full", "wgkv", "fastkvzip"))
    chosen = {
        name: (policies.get(name, budget=0.5), None)
        for name in ("snapkv", "h2o", "knorm", "observed_attention", "expected_attention")
    }
    assert read_groups.prefill_classes(chosen) == {
        "snapkv": 0,
        "h2o": 1,  # accumulates attention during prefill
        "knorm": 0,
        "observed_attention": 1,
        "expected_attention": 0,
    }


def test_finch_reads_the_question_as_its_window_and_runs_agnostic_only_when_given_one(tokenizer):
    sample = ruler_tasks.build_sample(tokenizer, "niah_single_1", 1024, 0)
    options = ruler.sample_options("finch", {}, sample)
    assert options == {"window": sample.question_turn_tokens} and sample.question_turn_tokens > 8
    assert ruler.sample_options("finch", {"window": 32}, sample) == {"window": 32}
    assert ruler.sample_options("snapkv", {}, sample) == {}
    parsed = harness.parse_ratio_policies(["finch", "snapkv"])
    ruler.check_settings(parsed, ["aware"])
    with pytest.raises(SystemExit, match="finch:window=N"):
        ruler.check_settings(parsed, ["agnostic", "aware"])
    ruler.check_settings(harness.parse_ratio_policies(["finch:window=32"]), ["agnostic"])
    with pytest.raises(ValueError, match="older export"):
        record = sample.to_json()
        del record["question_turn_tokens"]
        ruler_tasks.sample_from_json(record)


def test_each_wgkv_entry_has_its_calibration_file_and_a_missing_ratio_is_refused(tmp_path):
    assert wgkv_calibration.calibration_path(tmp_path, "wgkv").name == "wgkv-calibration.json"
    path = wgkv_calibration.calibration_path(tmp_path, "wgkv:window=64:sinks=4")
    assert path.name == "wgkv-calibration-window-64-sinks-4.json"
    with pytest.raises(SystemExit, match="run `jaxkv bench ruler` with it first"):
        wgkv_calibration.saved_taus(path, [0.5])
    path.write_text(json.dumps({"tau_per_ratio": {"0.5": 0.001, "0.75": 0.003}}))
    assert wgkv_calibration.saved_taus(path, [0.5]) == {0.5: 0.001, 0.75: 0.003}
    with pytest.raises(SystemExit, match=r"--ratios \[0.875\]: .* at \[0.5, 0.75\] only"):
        wgkv_calibration.saved_taus(path, [0.5, 0.875])


def cliff_kept_share(tau: float) -> float:
    """A learned gate's kept share: everything below tau 3e-4, a third of the tokens past 1e-3
    (the drop the real model's gates show), then a slow fall."""
    import math

    t = (math.log(tau) - math.log(3e-4)) / (math.log(1e-3) - math.log(3e-4))
    if t <= 1.0:
        return 1.0 - 0.64 * min(max(t, 0.0), 1.0) ** 3
    return 0.36 / (1.0 + math.log(tau / 1e-3))


@pytest.mark.parametrize("target", [0.75, 0.5, 0.25, 0.125])
def test_wgkv_taus_are_bisected_to_the_kept_share(target):
    calls = []

    def measure(tau):
        calls.append(tau)
        return cliff_kept_share(tau)

    grid = {tau: cliff_kept_share(tau) for tau in wgkv_calibration.TAUS}
    low = max(tau for tau, kept in grid.items() if kept > target)
    high = min(tau for tau, kept in grid.items() if kept < target)
    tau = wgkv_calibration.tau_for_kept_share(measure, dict(grid), target)
    assert abs(cliff_kept_share(tau) - target) <= wgkv_calibration.KEPT_TOLERANCE
    # each new measurement bisects the grid's bracket of the target
    assert all(low < call < high for call in calls)
    assert len(calls) <= wgkv_calibration.BISECTION_STEPS


def test_wgkv_takes_the_tau_past_a_jump_and_runs_a_ratio_it_cannot_hold_at_the_larger():
    def jump(tau):  # 64% of the tokens (whole heads with one gate value) switch at 5e-4
        return 1.0 if tau < 5e-4 else cliff_kept_share(max(tau, 1e-3))

    measured = {tau: jump(tau) for tau in wgkv_calibration.TAUS}
    taus = wgkv_calibration.taus_for_ratios(jump, measured, ruler_tasks.RATIOS)
    assert 5e-4 <= taus[0.5] < 5.01e-4 and jump(taus[0.5]) == cliff_kept_share(1e-3)
    assert taus[0.25] == taus[0.5]  # 75% is out of reach too: never more than the ratio
    assert abs(jump(taus[0.75]) - 0.25) <= wgkv_calibration.KEPT_TOLERANCE
    assert wgkv_calibration.superseded_ratios(taus) == {0.25: 0.5}
    calls = []
    again = wgkv_calibration.taus_for_ratios(calls.append, measured, ruler_tasks.RATIOS)
    assert again == taus and not calls
    with pytest.raises(ValueError, match=r"every tau measured keeps more than 0.010"):
        wgkv_calibration.tau_for_kept_share(jump, measured, 0.01)


def test_a_head_s_tie_is_its_ranked_tokens_sharing_the_lowest_kept_score():
    # sink (inf), five ranked, the newest protected; the head keeps the sink, 1, 2 and 6
    scores = np.array([np.inf, 3.0, 2.0, 2.0, 2.0 * (1 + 1e-7), 1.0, 0.5], np.float32)
    positions = np.arange(7)
    kept = np.array([0, 1, 2, 6, -1, -1, -1])
    protected = (positions < 1) | (positions >= 6)
    tie = score_ties.head_ties(scores, positions, kept, protected)
    assert tie == {"cut": 2.0, "tied": 3, "tied_kept": 1, "zeros": 0, "ranked": 5}
    apart = np.array([np.inf, 3.0, 2.0, 1.9, 1.8, 1.0, 0.5], np.float32)
    assert score_ties.head_ties(apart, positions, kept, protected) is None


def test_knorm_ties_at_its_cut_on_a_repeated_token_in_the_first_layer():
    """A token's keys in layer 0 differ only by RoPE, which keeps their norms: Knorm's cut
    falls among them when the repeats straddle it; `ties_at_cut` finds them there and the
    full cache, which ranks nothing, has none to find."""
    model = init_model(tiny_config(Family.LLAMA), seed=1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 64, 40).tolist()
    prompt[6:36] = [7] * 30  # one token 30 times: the cut of 20 kept falls among them
    ties = score_ties.ties_at_cut(model, policies.from_spec("knorm:0.5"), None, prompt)
    first = [t for t in ties if t["layer"] == 0]
    assert first and all(t["tied_kept"] < t["tied"] <= 30 for t in first)
    assert score_ties.ties_at_cut(model, policies.get("full"), None, prompt) is None
