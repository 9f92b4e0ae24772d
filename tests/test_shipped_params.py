"""The trained parameters jaxkv ships (`jaxkv.bundled.SHIPPED_PARAMS`): each one is in the
package, loads for its model's shapes and carries its training record; the CLI finds them by
the model, and a learned policy without them is a clear error."""

from __future__ import annotations

import json

import pytest

from jaxkv import bundled, cli, downloads, policies
from jaxkv.model_sources import shipped_name
from jaxkv.models import load_hf_checkpoint
from jaxkv.models.configs import model_shape
from tests import gguf_files

SHIPPED = [
    (model_name, kind, path)
    for model_name, shipped in bundled.SHIPPED_PARAMS.items()
    for kind, path in shipped.items()
]


def _config(model_name: str):
    if model_name == bundled.REFERENCE:
        return load_hf_checkpoint(bundled.REFERENCE_MODEL).config
    return model_shape(model_name)


@pytest.mark.parametrize(("model_name", "kind", "path"), SHIPPED)
def test_every_shipped_parameter_set_loads_for_its_model_and_has_its_record(model_name, kind, path):
    params = policies.get(kind).params.load(path, _config(model_name))
    assert params is not None
    directory = path if path.is_dir() else path.parent
    records = [directory / name for name in ("run.json", "training.json")]
    record = json.loads(next(p for p in records if p.exists()).read_text())
    assert f"jaxkv train {kind}" in record["command"]
    if model_name in downloads.KNOWN_MODELS:
        assert record["model_file_sha256"] == downloads.KNOWN_MODELS[model_name].sha256


def test_smollm2_ships_the_gates_and_heads_its_readme_results_use():
    shipped = bundled.SHIPPED_PARAMS[bundled.SMOLLM2]
    assert shipped["fastkvzip"].name == "docstrings-64-adamw"
    assert shipped["wgkv"].name == "docstrings-lambda-0.3-600"
    assert shipped["duo_attention"].parent.name == "copy-0.2"


def test_shipped_name_knows_the_reference_model_and_fetched_models_by_name_or_file(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(downloads.CACHE_ENV, str(tmp_path))
    assert shipped_name(bundled.REFERENCE_MODEL) == bundled.REFERENCE
    assert shipped_name(cli.DEFAULT_MODEL) == bundled.REFERENCE
    assert shipped_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    fetched = downloads.fetched_path("smollm2-135m-instruct")
    assert shipped_name(fetched) == "smollm2-135m-instruct"
    assert shipped_name(tmp_path / "other.gguf") is None


@pytest.mark.parametrize("spec", ["fastkvzip:0.3", "wgkv"])
def test_a_learned_policy_on_a_model_without_shipped_gates_names_the_models_that_have_them(
    tmp_path, capsys, spec
):
    policy = spec.split(":")[0]
    gguf = tmp_path / "tiny.gguf"
    gguf_files.write_gguf(gguf, gguf_files.random_model("qwen2-bias"), "qwen2", "F16", "qwen2")
    argv = ["generate", "--model", str(gguf), "--prompt", "hello", "--policy", spec]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert f"policy {policy!r} needs trained parameters" in error
    assert f"jaxkv ships them for reference, smollm2-135m-instruct, not for --model {gguf}" in error
    assert "give --gates PATH" in error


def test_a_missing_gates_path_is_a_clear_error_for_every_learned_policy(tmp_path):
    config = _config(bundled.REFERENCE)
    missing = tmp_path / "nowhere"
    for kind, match in [
        ("wgkv", "no write gates at"),
        ("fastkvzip", "no Fast KVzip gates at"),
        ("duo_attention", "no DuoAttention heads at"),
    ]:
        with pytest.raises(FileNotFoundError, match=match):
            policies.get(kind).params.load(missing, config)
