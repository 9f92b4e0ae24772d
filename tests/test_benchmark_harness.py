"""The benchmarks' shared provenance block and report writer."""

import json
import re

import jax

from jaxkv.benchmarks import harness


def test_provenance_names_the_command_the_software_and_the_machine():
    block = harness.provenance("jaxkv bench plan", ["--contexts", "1024"])
    assert block["command"] == "jaxkv bench plan --contexts 1024"
    assert block["jax"] == jax.__version__
    assert block["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", block["commit"])
    assert re.match(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}", block["date"])
    machine = block["machine"]
    assert machine["device"].startswith(jax.devices()[0].platform)
    assert machine["num_devices"] == jax.device_count()
    assert len(machine["load_average_at_start"]) == 3


def test_save_writes_the_json_and_the_markdown_side_by_side(tmp_path):
    report = {"rows": [{"trace": list(range(5))}]}
    harness.save(tmp_path / "out", "run", report, "| a |\n")
    assert json.loads((tmp_path / "out" / "run.json").read_text()) == report
    assert (tmp_path / "out" / "run.md").read_text() == "| a |\n"
    harness.save(tmp_path, "flat", report, indent=None)
    assert len((tmp_path / "flat.json").read_text().splitlines()) == 1
    assert not (tmp_path / "flat.md").exists()


def test_commands_so_far_lists_each_resumed_command_once_in_first_run_order(tmp_path):
    run = tmp_path / "run.json"
    assert harness.commands_so_far(run, "a") == ["a"]
    run.write_text(json.dumps({"commands": ["a", "b", "a", "c", "b"]}))
    assert harness.commands_so_far(run, "b") == ["a", "b", "c"]
    assert harness.commands_so_far(run, "d") == ["a", "b", "c", "d"]


def test_read_bandwidth_times_a_read_of_every_byte(monkeypatch):
    seen = {}

    def one_second(fn, x, repeats):
        seen["sums"] = fn(x)
        return 1.0

    monkeypatch.setattr(harness, "seconds_per_call", one_second)
    num_bytes = 8 * 4 * harness.READ_ROW
    assert harness.read_bandwidth(num_bytes, repeats=1) == num_bytes
    assert seen["sums"].shape == (8,) and float(seen["sums"][0]) == harness.READ_ROW
