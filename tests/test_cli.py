"""The `jaxkv generate` command on a checkpoint directory and on the built-in default."""

import json

from jaxkv import cli
from models import byte_tokenizer, init_model, save_hf_checkpoint
from models.configs import preset


def _report(capsys):
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def test_generate_from_a_checkpoint_directory(tmp_path, capsys):
    save_hf_checkpoint(init_model(preset("tiny-random"), seed=3), tmp_path)
    byte_tokenizer().save(tmp_path)
    argv = [
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "abc",
        "--max-new-tokens",
        "5",
        "--page-size",
        "4",
    ]
    assert cli.main(argv) == 0
    report = _report(capsys)
    assert report["prompt_tokens"] == 4  # <|bos|> a b c
    assert report["generated_tokens"] <= 5
    # 2 layers x 2 KV heads, each holding <= 8 tokens in pages of 4.
    assert report["pages_in_use_final"] == 2 * 2 * 2


def test_bad_arguments_exit_with_a_message(capsys):
    assert cli.main(["generate", "--policy", "nope", "--max-new-tokens", "2"]) == 2
    assert "policy='nope'" in capsys.readouterr().err
    assert cli.main(["generate", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens=0" in capsys.readouterr().err


def test_generate_with_a_compression_policy(capsys):
    argv = [
        "generate",
        "--policy",
        "snapkv",
        "--budget",
        "0.5",
        "--max-new-tokens",
        "3",
        "--page-size",
        "4",
        "--prompt",
        "x" * 150,
    ]
    assert cli.main(argv) == 0
    report = _report(capsys)
    # 151 prompt tokens -> 75 kept per head, 6 layers x 2 KV heads, pages of 4 tokens.
    assert report["pages_in_use_after_prefill"] == 6 * 2 * 19


def test_default_job_retrieves_the_fact_with_the_reference_model(capsys):
    assert cli.main(["generate", "--max-new-tokens", "9"]) == 0
    assert "output: '4821937.\\n'" in capsys.readouterr().out
