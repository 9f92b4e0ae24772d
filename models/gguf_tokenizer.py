"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library.

llama.cpp stores a byte-level BPE tokenizer as its vocabulary (`tokenizer.ggml.tokens`, spelled in
GPT-2's byte alphabet), its merges, each token's type (normal, control, user-defined, ...), the
special ids, the add-BOS rule and the name of its pre-tokenizer (`tokenizer.ggml.pre`), which
fixes how text is split before BPE. Each pre-tokenizer name maps to the split llama.cpp applies
for it; an unknown name is an error rather than a guess, since a wrong split gives other ids.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxkv.models.gguf_loading import GGUFFile
from jaxkv.models.tokenizer import Tokenizer, bytes_to_unicode

# GPT-2's split: contractions, letters, numbers, other symbols, each with one leading space.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer name -> the regex splits applied in turn (each match isolated), and whether BPE
# first looks a whole piece up in the vocabulary (Llama 3's `ignore_merges`).
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    # SmolLM, StarCoder and others split every digit apart before GPT-2's split.
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),
    "starcoder": ((r"\p{N}", _GPT2_SPLIT), False),
    "refact": ((r"\p{N}", _GPT2_SPLIT), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def _byte_spelling(tokens: list[str]) -> list[str]:
    """Tokens in GPT-2's byte alphabet; a file that wrote one in plain UTF-8 is respelled."""
    alphabet = bytes_to_unicode()
    letters = set(alphabet.values())
    return [
        token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))
        for token in tokens
    ]


def _pre_tokenizer(splits: tuple[str, ...]):
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
    return pre_tokenizers.Sequence(
        [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def gguf_tokenizer(source: str | os.PathLike | GGUFFile) -> Tokenizer:
    """The byte-level BPE tokenizer of a GGUF file (`tokenizer.ggml.model` = "gpt2")."""
    file = source if isinstance(source, GGUFFile) else GGUFFile(source)
    kind = file.value("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{file.path}: tokenizer.ggml.model={kind!r} is not supported: only byte-level "
            "BPE ('gpt2', as Llama 3, SmolLM2 and Qwen write) is"
        )
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{file.path}: tokenizer.ggml.pre={pre!r} is not supported: supported are "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    splits, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = _byte_spelling(file.required("tokenizer.ggml.tokens"))
    merges = [tuple(merge.split(" ", 1)) for merge in file.required("tokenizer.ggml.merges")]
    backend = HFTokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            ignore_merges=ignore_merges,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(splits)
    backend.decoder = decoders.ByteLevel()
    kinds = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(kinds) != len(tokens):
        raise ValueError(
            f"{file.path}: tokenizer.ggml.token_type has {len(kinds)} entries for "
            f"{len(tokens)} tokens"
        )
    typed = list(zip(tokens, kinds, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED]
    )
    eos = file.value("tokenizer.ggml.eos_token_id")
    pad = file.value("tokenizer.ggml.padding_token_id", eos)
    return Tokenizer(
        backend=backend,
        bos_id=file.value("tokenizer.ggml.bos_token_id"),
        eos_id=eos,
        pad_id=pad if pad is not None else 0,
        adds_bos=bool(file.value("tokenizer.ggml.add_bos_token", False)),
        chat_template=file.value("tokenizer.chat_template"),
    )
