"""`jaxkv serve`'s options reach the server (its request defaults, the warm-up) or are refused;
the serving benchmarks' help; the budget in `jaxkv generate`'s report. The server itself is not
started: uvicorn.run is replaced."""

import json
import re

import pytest
import uvicorn

import jaxkv.serve
from jaxkv import bundled, cli, policies
from jaxkv.serve import RequestDefaults


@pytest.fixture
def served(monkeypatch) -> dict:
    """What `jaxkv serve` hands the server: create_app's keyword arguments, and whether
    uvicorn.run was called with its app."""
    seen = {}

    def create_app(engine, tokenizer, **options):
        seen.update(options, engine=engine)
        return "the app"

    monkeypatch.setattr(jaxkv.serve, "create_app", create_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: seen.update(ran=app))
    return seen


def test_serve_s_sampling_options_are_the_server_s_request_defaults(served):
    argv = ["serve", "--num-pages", "64", "--max-new-tokens", "40", "--temperature", "0"]
    argv += ["--top-k", "5", "--top-p", "0.9", "--no-warm-up"]
    assert cli.main(argv) == 0
    assert served["defaults"] == RequestDefaults(
        max_new_tokens=40, temperature=0.0, top_k=5, top_p=0.9
    )
    assert served["warm_up_first"] is False and served["ran"] == "the app"
    assert served["engine"].stats()["num_pages"] == 64
    assert cli.main(["serve", "--num-pages", "64"]) == 0
    assert served["warm_up_first"] is True
    assert served["defaults"] == RequestDefaults(max_new_tokens=16, temperature=0.0)


def test_serve_answers_to_the_model_s_short_name_or_the_one_given(served):
    assert cli.main(["serve", "--num-pages", "64", "--no-warm-up"]) == 0
    assert served["model_name"] == bundled.REFERENCE  # not the checkpoint's path
    argv = ["serve", "--num-pages", "64", "--no-warm-up", "--served-model-name", "mine"]
    assert cli.main(argv) == 0
    assert served["model_name"] == "mine"


def test_serve_runs_the_engine_over_the_mesh_it_names(served):
    assert cli.main(["serve", "--num-pages", "64", "--mesh", "2x1", "--no-warm-up"]) == 0
    mesh = served["engine"].placement
    assert (mesh.data, mesh.model) == (2, 1) and served["ran"] == "the app"


def test_serve_runs_int8_storage_with_a_pool_of_its_own(served):
    argv = ["serve", "--num-pages", "64", "--storage", "int8", "--int8-pages", "32"]
    assert cli.main([*argv, "--full-precision-window", "32", "--no-warm-up"]) == 0
    engine = served["engine"]
    assert engine.stats()["int8_num_pages"] == 32 and engine.cache.full_precision_window == 32


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (["--mesh", "2"], "--mesh 2: give the mesh's sizes as DATAxMODEL, e.g. 2x4"),
        (["--mesh", "3x1"], "max_slots=8 must be a multiple of the mesh's data axis"),
        (["--int8-pages", "8"], "int8_pages sizes an int8 tier: give it with storage='int8'"),
        (["--storage", "int8", "--policy", "quest"], "selects pages, which int8 storage does"),
        (["--full-precision-window", "8"], "--full-precision-window: --storage model keeps"),
        (["--top-p", "1.5"], r"top_p=1.5: allowed are numbers in \(0, 1\]"),
        (["--temperature", "-1"], "temperature=-1.0: allowed are finite numbers >= 0"),
        (["--top-k", "0"], "top_k=0: allowed are integers >= 1"),
    ],
)
def test_serve_refuses_options_it_would_ignore_or_could_not_use(served, capsys, options, match):
    assert cli.main(["serve", "--num-pages", "64", *options]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert "ran" not in served


@pytest.mark.parametrize("name", ["reuse", "serve"])
def test_the_serving_benchmarks_help_says_each_option_and_its_default(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", name, "-h"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = text[text.index("options:") :]
    # One block per option: its flags, then its help, which ends with the default.
    blocks = re.split(r"\n  (?=-)", options)[1:]
    assert len(blocks) > 5
    for block in blocks:
        if block.startswith("-h"):
            continue
        flags, _, help_text = block.partition("  ")
        assert help_text.strip(), f"{flags}: no help"
        assert "(default: " in " ".join(block.split()), f"{flags}: no default"


def test_generate_reports_the_budget_the_policy_runs_with(capsys):
    argv = ["generate", "--policy", "kvzip:0.3", "--max-new-tokens", "2", "--prompt", "x" * 200]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["budget"] == 0.3
    assert cli.policy_budget(policies.from_spec("snapkv:64")) == 64
    assert cli.policy_budget(policies.get("snapkv", budget=0.25)) == 0.25
    assert cli.policy_budget(policies.get("full")) is None
