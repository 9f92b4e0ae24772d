"""The `jaxkv generate` command on a checkpoint directory and on the built-in default."""

import json
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxkv import cli, policies
from jaxkv.attention.dispatch import Backend
from jaxkv.gates import fastkvzip as fastkvzip_gate
from jaxkv.gates.wgkv import init_write_gates, save_write_gates
from jaxkv.generation import mesh as programs
from jaxkv.models import byte_tokenizer, init_model, save_hf_checkpoint
from jaxkv.models.configs import preset
from jaxkv.policies import spec
from tests.test_lowering import MOSAIC_CALL, TRITON_CALL


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
    assert "--policy 'nope': registered policies are adakv, block" in capsys.readouterr().err
    assert cli.main(["generate", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens=0 must be >= 1" in capsys.readouterr().err


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


# --- a new user's first hour (issue 17) ----------------------------------------------------

TINY = ["--model", "tiny-random", "--max-new-tokens", "2", "--page-size", "4"]
TINY_PROMPT = ["--prompt", "The quick brown fox jumps over the lazy dog. " * 2]


def _error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("option", "match"),
    [
        (["--temperature", "nan"], "temperature=nan: allowed are finite numbers >= 0"),
        (["--temperature", "inf"], "temperature=inf: allowed are finite numbers >= 0"),
        (["--temperature", "1", "--top-p", "nan"], r"top_p=nan: allowed are numbers in (0, 1]"),
        (["--temperature", "1", "--top-k", "0"], "top_k=0: allowed are integers >= 1"),
    ],
)
def test_bad_sampler_settings_are_a_clean_error(capsys, option, match):
    assert cli.main(["generate", *TINY, *option]) == 2
    assert match in _error(capsys)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        (["--page-size", "6"], "page_size=6 must be a positive power of two"),
        (["--storage", "int8", "--full-precision-window", "-1"], "full_precision_window=-1"),
        (["--storage", "int8", "--policy", "quest", "--budget", "8"], "selects pages"),
    ],
)
def test_bad_cache_settings_are_a_clean_error(capsys, option, match):
    assert cli.main(["generate", *TINY, *option]) == 2
    assert match in _error(capsys)


@pytest.mark.parametrize(
    ("text", "value"), [("0.3", 0.3), ("256", 256), ("1e-1", 0.1), ("30%", 0.3), ("1.0", 1.0)]
)
def test_budget_vocabulary(text, value):
    parsed = spec.parse_budget(text)
    assert parsed == pytest.approx(value) and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["nan", "-1", "abc", "0", "1.5", "inf", "0%"])
def test_bad_budgets_name_the_option_and_the_forms(capsys, text):
    assert cli.main(["generate", *TINY, "--policy", "snapkv", "--budget", text]) == 2
    error = _error(capsys)
    assert f"--budget {text!r}: give a ratio of the prompt in (0, 1]" in error
    assert "or a token count >= 1 (256)" in error


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--policy", "full", "--budget", "0.3"], "--budget 0.3: policy 'full' takes no budget"),
        (["--policy", "kvzip", "--budget", "256"], "policy 'kvzip' keeps a ratio of the prompt"),
        (["--policy", "confkv", "--budget", "64"], "--policy-arg tight=N --policy-arg loose=N"),
        (
            ["--policy", "snapkv", "--policy-arg", "windw=3"],
            "--policy-arg 'windw=3': give KEY=VALUE with KEY one of the fields of policy "
            "'snapkv': budget, sinks, recent, window, kernel",
        ),
        (["--policy", "snapkv", "--policy-arg", "window=x"], "window=x: expected int"),
        (["--policy", "wgkv", "--policy-arg", "tau=2"], "tau=2.0 must be in (0, 1)"),
        (["--policy", "snapkv", "--gates", "g.npy"], "--gates: policy 'snapkv' takes no param"),
        (["--policy", "wgkv"], "'wgkv' needs trained parameters and jaxkv ships them for ref"),
    ],
)
def test_bad_policy_options_are_a_clean_error(capsys, argv, match):
    assert cli.main(["generate", *TINY, *argv]) == 2
    assert match in _error(capsys)


def test_policy_help_lists_the_registered_policies(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "-h"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(policies.registered()) in help_text


def test_policy_args_parse_by_the_field_type():
    kwargs = cli.policy_kwargs(
        "streaming_llm",
        ["sinks=8", "recent=0"],
        "30%",
    )
    assert kwargs == dict(sinks=8, recent=0, budget=pytest.approx(0.3))
    assert cli.policy_kwargs("wgkv", ["tau=0.2", "window=32"], None) == dict(tau=0.2, window=32)
    assert cli.policy_kwargs("confkv", ["pyramid=true", "tight=64"], None) == dict(
        pyramid=True, tight=64
    )
    assert cli.policy_kwargs("fastkvzip", ["window=none"], "0.1") == dict(window=None, budget=0.1)


def _tiny_gates(tmp_path):
    cfg = preset("tiny-random")
    save_write_gates(init_write_gates(cfg, jax.random.PRNGKey(0)), tmp_path / "wgkv.safetensors")
    fastkvzip_gate.save_safetensors(
        fastkvzip_gate.init_params(cfg, jax.random.PRNGKey(0)), tmp_path / "fkz.safetensors"
    )
    np.save(tmp_path / "duo.npy", np.array([[True, False], [False, False]]))
    filters = policies.get("qfilter").params.init(cfg, jax.random.PRNGKey(0))["filters"]
    np.save(tmp_path / "filters.npy", np.asarray(filters))
    stats = policies.get("expected_attention_stats").params.init(cfg, jax.random.PRNGKey(0))
    np.savez(tmp_path / "statistics.npz", **{k: np.asarray(v) for k, v in stats.items()})
    surrogate = policies.get("kvzap").params.init(cfg, jax.random.PRNGKey(0))
    np.savez(tmp_path / "mlp.npz", **{k: np.asarray(v) for k, v in surrogate.items()})
    curve = policies.get("lukv").params.init(cfg, jax.random.PRNGKey(0))["prune_shares"]
    np.save(tmp_path / "curve.npy", np.moveaxis(np.asarray(curve), 1, 0))  # kvpress's layout
    return {
        "wgkv": str(tmp_path / "wgkv.safetensors"),
        "fastkvzip": str(tmp_path / "fkz.safetensors"),
        "duo_attention": str(tmp_path / "duo.npy"),
        "qfilter": str(tmp_path / "filters.npy"),
        "expected_attention_stats": str(tmp_path / "statistics.npz"),
        "kvzap": str(tmp_path / "mlp.npz"),
        "lukv": str(tmp_path / "curve.npy"),
    }


# Options that fit every registered policy to a 136-token prompt.
POLICY_OPTIONS = {
    "snapkv": ["--budget", "32", "--policy-arg", "window=8"],
    "pyramidkv": ["--budget", "32", "--policy-arg", "window=8"],
    "adakv": ["--budget", "0.5", "--policy-arg", "inner=tova"],
    "confkv": [
        "--policy-arg",
        "tight=16",
        "--policy-arg",
        "loose=32",
        "--policy-arg",
        "protected=4",
    ],
    "wgkv": ["--policy-arg", "window=16", "--policy-arg", "tau=0.2"],
    "local_attention": ["--policy-arg", "window=16", "--policy-arg", "sinks=2"],
    "duo_attention": ["--policy-arg", "window=16"],
    "kvzip": ["--budget", "30%"],
    "fastkvzip": ["--budget", "0.5", "--policy-arg", "window=8"],
    "quest": ["--budget", "16"],
    "decoding": ["--policy-arg", "target_size=8", "--policy-arg", "compression_interval=1"],
    "cam": ["--policy-arg", "target_size=100", "--policy-arg", "compression_interval=1"],
    "dms": ["--policy-arg", "threshold=-1.0", "--policy-arg", "window=4"],
    "simlayerkv": ["--policy-arg", "lazy_threshold=0.1", "--policy-arg", "n_recent=8"],
    "think": ["--policy-arg", "key_channel_ratio=0.5"],
    "per_layer": ["--policy-arg", "budgets=0.5,0.3"],
}


# Over splash attention's 128-token tile: the prefill's causal attention goes through it on a TPU.
SWEEP_PROMPT = ["--prompt", "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture
def lowered_for_tpu(monkeypatch):
    """Runs each program as it is, and lowers the same program for "tpu" with backend
    "pallas" where it runs with a backend: {program name: lowered StableHLO text}."""
    texts: dict[str, str] = {}
    run = programs.Program._run

    def run_and_lower(self, mesh, arguments):
        if arguments.get("backend") in (Backend.XLA, Backend.INTERPRET_TPU):
            on_tpu = arguments | {"backend": Backend.PALLAS}
            lowered = self.jitted.trace(**on_tpu).lower(lowering_platforms=("tpu",))
            texts[self.fn.__name__] = lowered.as_text()
        return run(self, mesh, arguments)

    monkeypatch.setattr(programs.Program, "_run", run_and_lower)
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("name", policies.registered())
def test_every_registered_policy_runs_through_the_cli_and_its_programs_lower_for_tpu(
    tmp_path, capsys, lowered_for_tpu, name
):
    """The TPU path checked on the same run: each program the CLI runs, traced again for "tpu"
    with backend "pallas", holds Mosaic calls and never a Triton call. The policies that score
    the prompt run splash attention inside the layer scan, where a kernel first built inside a
    trace used to leak that trace's arrays into the next one."""
    options = POLICY_OPTIONS.get(name, [] if name in ("full", "gvote") else ["--budget", "0.5"])
    gates = _tiny_gates(tmp_path)
    if name in gates:
        options = [*options, "--gates", gates[name]]
    assert cli.main(["generate", *TINY, *SWEEP_PROMPT, "--policy", name, *options]) == 0
    report = _report(capsys)
    assert report["policy"] == name and report["prompt_tokens"] == 136
    assert report["policy_params"] == gates.get(name)
    assert any("decode_loop" in program for program in lowered_for_tpu), sorted(lowered_for_tpu)
    assert any("prefill" in program for program in lowered_for_tpu), sorted(lowered_for_tpu)
    for program, text in lowered_for_tpu.items():
        assert TRITON_CALL not in text, program
        assert MOSAIC_CALL in text, program


def test_duo_attention_picks_retrieval_heads_on_the_prompt(capsys):
    argv = ["generate", *TINY, *TINY_PROMPT, "--policy", "duo_attention"]
    share = ["--policy-arg", "retrieval_share=0.5"]
    assert cli.main([*argv, "--policy-arg", "window=16", *share]) == 0
    assert _report(capsys)["policy_params"] == "picked on the prompt"


def test_wgkv_runs_with_the_shipped_gates_of_the_reference_model(capsys):
    assert cli.main(["generate", "--policy", "wgkv", "--max-new-tokens", "9"]) == 0
    out = capsys.readouterr().out
    assert "output: '4821937.\\n'" in out
    assert json.loads(out[out.index("{") :])["policy_params"].endswith("lambda-0.08")


def test_model_loading_errors_are_one_line_without_traceback(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nowhere")]) == 2
    error = _error(capsys)
    assert f"--model '{tmp_path / 'nowhere'}': not found; give a checkpoint directory" in error
    assert "smollm2-135m-instruct" in error and "preset (tiny-random)" in error
    save_hf_checkpoint(init_model(preset("tiny-random"), seed=0), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert cli.main(["generate", "--model", str(tmp_path)]) == 2
    assert f"checkpoint directory {tmp_path} holds neither model.safetensors" in _error(capsys)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab')
    assert cli.main(["generate", "--model", str(tmp_path)]) == 2
    assert f"{tmp_path / 'config.json'} is not valid JSON" in _error(capsys)


@pytest.mark.parametrize("name", ["decode", "kernels", "quality"])
def test_benchmark_help_names_the_jaxkv_command(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", name, "-h"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: jaxkv bench {name} ")


def test_bench_runs_the_system_benchmark(monkeypatch):
    calls = []
    module = types.ModuleType("jaxkv.benchmarks.system")
    module.main = calls.append
    monkeypatch.setitem(sys.modules, "jaxkv.benchmarks.system", module)
    assert cli.main(["bench", "system", "--quick"]) == 0
    assert calls == [["--quick"]]


def test_ask_answers_each_question_over_one_shared_copy_of_the_context(tmp_path, capsys):
    context = tmp_path / "context.txt"
    context.write_text(
        "def lookup(table, key):\n"
        "    # The special magic number for amber-otter is 4821937.\n"
        "    # The special magic number for blue-heron is 7712093.\n"
        "    return table[key]\n"
    )
    questions = [
        f"# What is the special magic number for {name}? The special magic number for {name} is"
        for name in ("amber-otter", "blue-heron")
    ]
    argv = ["ask", "--context", str(context), "--policy", "snapkv:0.5", "--max-new-tokens", "9"]
    assert cli.main([*argv, *(a for q in questions for a in ("--question", q))]) == 0
    out = capsys.readouterr().out
    assert f"Q1: {questions[0]}\nA1: " in out and f"Q2: {questions[1]}\nA2: " in out
    report = json.loads(out[out.index("{") :])
    assert report["questions"] == 2
    assert report["kv_bytes_total"] == report["kv_bytes_shared_context"] + sum(
        report["kv_bytes_per_row"]
    )
    assert report["kv_bytes_total"] < report["kv_bytes_one_copy_per_question"]
    assert 0 < report["prefill_compile_seconds"] <= report["prefill_seconds"]
    assert 0 < report["decode_compile_seconds"] <= report["decode_seconds"]
    assert report["decode_tokens_per_second"] > 0


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--question", "q"], "the text is empty"),
        ([], "give at least one --question"),
        (["--question", "q", "--policy", "snapkv:0.5", "--budget", "0.3"], "is a spec"),
    ],
)
def test_bad_ask_arguments_are_a_clean_error(tmp_path, capsys, argv, match):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    context = empty if match == "the text is empty" else Path(__file__)
    assert cli.main(["ask", "--context", str(context), *argv]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "command,argv,match",
    [
        (
            "generate",
            ["--policy", "fastkvzip"],
            "give it: --policy fastkvzip:0.3 (or --budget 0.3)",
        ),
        ("ask", ["--policy", "kvzip"], "give it: --policy kvzip:0.3"),
        ("generate", ["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
        ("ask", ["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
        ("serve", ["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
        ("generate", ["--policy", "wgkv", "--gates", "/nowhere/gates"], "--gates /nowhere/gates"),
        ("generate", ["--model", "/nowhere/model.gguf"], "'/nowhere/model.gguf': not found"),
        ("serve", ["--model", "/nowhere/model.gguf"], "'/nowhere/model.gguf': not found"),
        ("ask", ["--policy", "h2o:64", "--max-new-tokens", "40"], "evicts during decode"),
    ],
)
def test_options_are_checked_before_the_model_loads(
    tmp_path, capsys, monkeypatch, command, argv, match
):
    """A real model takes tens of seconds to load: what is wrong without it is said first."""
    import jaxkv.model_sources

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(jaxkv.model_sources, "load_model", no_loading)
    context = tmp_path / "context.txt"
    context.write_text("a context")
    extra = ["--context", str(context), "--question", "q?"] if command == "ask" else []
    assert cli.main([command, *extra, *argv]) == 2
    assert match in _error(capsys)


def test_a_redirected_run_logs_its_prefill_and_reports_times_without_compiling(capsys):
    """stderr is not a terminal here: the prefill's chunks, the compression and the
    compilations still show as log lines, and the rate leaves the compilation out."""
    prompt = "def lookup(table, key):\n    return table[key]\n" * 25  # 1,150 bytes: 3 chunks
    argv = ["generate", "--policy", "snapkv:0.5", "--prompt", prompt, "--max-new-tokens", "6"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line for line in lines if "prefill:" in line] == [
        f"jaxkv: prefill: {done} of 3 chunks" for done in (1, 2, 3)
    ]
    assert "jaxkv: compressing the prompt (policy snapkv) ..." in lines
    assert any(line.startswith("jaxkv: compiled ") for line in lines)
    report = json.loads(captured.out[captured.out.index("{") :])
    assert 0 < report["prefill_compile_seconds"] <= report["prefill_seconds"]
    assert 0 < report["decode_compile_seconds"] <= report["decode_seconds"]
    running = report["decode_seconds"] - report["decode_compile_seconds"]
    rate = report["generated_tokens"] / running
    assert report["decode_tokens_per_second"] == pytest.approx(rate, rel=0.25)  # rounded times
    assert (
        report["decode_tokens_per_second"] > report["generated_tokens"] / report["decode_seconds"]
    )
