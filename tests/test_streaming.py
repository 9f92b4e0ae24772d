"""Tokens streamed from inside the jitted decode loop (`on_token`), timings in the result, and
text in, text out (`generate_text`); the CLI's --stream, --prompt-file and --system."""

import ast

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import Sampler, bundled, cli
from jaxkv.models import byte_tokenizer, load_hf_checkpoint

PROMPTS = [list(b"The special magic number for amber-otter is 4821937. It is "), list(b"Hi")]


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


def test_streamed_tokens_are_the_result_s_in_order(model):
    seen = []
    sampler, key = Sampler(temperature=1.0), jax.random.PRNGKey(2)
    out = jaxkv.generate(
        model,
        PROMPTS,
        max_new_tokens=12,
        sampler=sampler,
        key=key,
        on_token=lambda step, tokens, done: seen.append((step, tokens.copy(), done.copy())),
    )
    assert [step for step, _, _ in seen] == list(range(len(seen)))
    np.testing.assert_array_equal(np.stack([t for _, t, _ in seen], axis=1), out.tokens)
    quiet = jaxkv.generate(model, PROMPTS, max_new_tokens=12, sampler=sampler, key=key)
    np.testing.assert_array_equal(quiet.tokens, out.tokens)
    assert out.prefill_seconds > 0 and out.decode_seconds > 0 and out.tokens_per_second > 0
    session = jaxkv.prefill(model, PROMPTS)
    again = []
    decoded = jaxkv.decode(session, 5, on_token=lambda step, tokens, done: again.append(step))
    assert again == [0, 1, 2, 3, 4] and decoded.prefill_seconds is None


def test_generate_text_takes_text_and_chat_messages_and_returns_replies(model):
    tokenizer = byte_tokenizer()
    texts = jaxkv.generate_text(
        model, tokenizer, [bytes(p).decode() for p in PROMPTS], max_new_tokens=8
    )
    out = jaxkv.generate(
        model,
        [tokenizer.encode(bytes(p).decode()) for p in PROMPTS],
        max_new_tokens=8,
        stop_tokens=[tokenizer.eos_id, *model.config.eos_token_ids],
        pad_id=tokenizer.pad_id,
    )
    for text, row, n in zip(texts, out.tokens, out.num_tokens, strict=True):
        assert text == tokenizer.decode([t for t in row[:n] if t != tokenizer.eos_id])
    with pytest.raises(ValueError, match="no chat template"):
        jaxkv.generate_text(model, tokenizer, "Hi", max_new_tokens=2, chat=True)
    with pytest.raises(ValueError, match="system= is a chat message"):
        jaxkv.generate_text(model, tokenizer, "Hi", max_new_tokens=2, system="Be brief.")


def test_the_cli_streams_reads_a_prompt_file_and_reports_speed_and_share(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(cli.DEFAULT_PROMPT)
    assert cli.main(["generate", "--prompt-file", str(prompt), "--max-new-tokens", "9"]) == 0
    plain = capsys.readouterr().out
    assert (
        cli.main(["generate", "--prompt-file", str(prompt), "--max-new-tokens", "9", "--stream"])
        == 0
    )
    streamed = capsys.readouterr().out
    answer = plain.split("output: ")[1].split("\n")[0]
    assert f"output: {ast.literal_eval(answer)}" in streamed  # the same text, as it came
    report = streamed[streamed.index("{") :]
    assert '"kv_share_of_full_cache": 1.0' in report and '"decode_tokens_per_second"' in report
    assert cli.main(["generate", "--system", "Be brief.", "--max-new-tokens", "2"]) == 2
    assert "--system is a chat message" in capsys.readouterr().err
    long_prompt = "word " * 400
    assert cli.main(["generate", "--prompt", long_prompt, "--max-new-tokens", "1"]) == 0
    assert len(capsys.readouterr().out.split("\n")[0]) < 300


def test_a_first_call_says_it_is_compiling_and_a_second_does_not(caplog):
    from jaxkv.models import init_model
    from tests.tiny_models import tiny_config

    model = init_model(tiny_config(num_layers=3), seed=0)  # shapes no other test compiles
    with caplog.at_level("INFO", logger="jaxkv"):
        jaxkv.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=3)
    first = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("compiling prefill_and_compress for new shapes") for m in first)
    assert any(m.startswith("compiled decode_loop in ") for m in first)
    caplog.clear()
    with caplog.at_level("INFO", logger="jaxkv"):
        jaxkv.generate(model, [[1, 2, 3, 4, 6]], max_new_tokens=3)
    assert not [r for r in caplog.records if "compil" in r.getMessage()]
