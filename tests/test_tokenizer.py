"""The built-in byte-level tokenizer, its tokenizer.json, and loading through transformers."""

import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.models import byte_tokenizer, load_tokenizer


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_tokenizer_ids_are_the_utf8_bytes(text):
    tok = byte_tokenizer()
    ids = tok.encode(text, add_bos=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_specials_and_saved_tokenizer_json(tmp_path):
    tok = byte_tokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.encode("ab") == [256, 97, 98]
    assert tok.decode([256, 97, 257, 98]) == "ab"
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (256, 257, 258)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    assert loaded.encode(text) == tok.encode(text)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert fast.decode(tok.encode(text, add_bos=False)) == text
