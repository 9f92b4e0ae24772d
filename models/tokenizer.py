"""Tokenizers: any `tokenizer.json` via the `tokenizers` library, and the built-in byte-level one.

The byte-level tokenizer maps byte b to id b (0-255) and appends special tokens. It is built with
the `tokenizers` library itself, so that it saves to a `tokenizer.json` that Hugging Face
`transformers` loads, and one code path serves both kinds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` with the ids generation needs.

    Attributes:
      adds_bos: whether `encode` prepends `bos_id` unless told otherwise (the model's rule:
        SmolLM2 and Qwen add none, Llama 3 does).
      chat_template: the model's Jinja chat template, if it ships one (`chat.apply_chat_template`).
    """

    backend: HFTokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    adds_bos: bool = True
    chat_template: str | None = None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in it are matched whole.

        add_bos: prepend `bos_id`; default the tokenizer's own rule (`adds_bos`).
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        add_bos = self.adds_bos if add_bos is None else add_bos
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def token(self, token_id: int) -> str:
        """The vocabulary's spelling of one id (special tokens as written, e.g. <|im_end|>)."""
        return self.backend.id_to_token(int(token_id))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.backend.save(str(Path(directory) / "tokenizer.json"))


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0-255 are bytes, then <|bos|> 256, <|eos|> 257, <|pad|> 258."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    return Tokenizer(backend=backend, bos_id=256, eos_id=257, pad_id=258)


@functools.cache
def _byte_vocabulary() -> tuple[tuple[str, int], ...]:
    return tuple(sorted(byte_tokenizer().backend.get_vocab(with_added_tokens=True).items()))


def is_byte_tokenizer(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` has `byte_tokenizer()`'s vocabulary (ids 0-255 are the bytes)."""
    vocabulary = tokenizer.backend.get_vocab(with_added_tokens=True)
    return tuple(sorted(vocabulary.items())) == _byte_vocabulary()


def token_ids_of_bytes(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """The ids of raw text bytes, no bos: the bytes themselves for the byte-level tokenizer (so a
    multi-byte character cut at either end stays exact), else the ids of the UTF-8 text with a
    cut character dropped."""
    if is_byte_tokenizer(tokenizer):
        return list(data)
    return tokenizer.encode(data.decode("utf-8", errors="ignore"), add_bos=False)


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """An upper bound on the bytes of text one token covers (1 for the byte-level tokenizer),
    so that `n * max_token_bytes` bytes of text hold at least `n` tokens."""
    if is_byte_tokenizer(tokenizer):
        return 1
    vocabulary = tokenizer.backend.get_vocab(with_added_tokens=False)
    return max(len(token.encode("utf-8")) for token in vocabulary)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel pre-tokenizer's)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Loads `tokenizer.json` from a checkpoint directory; bos/eos/pad read from its specials."""
    file = Path(directory) / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(
            f"checkpoint directory {directory} has no tokenizer.json: save the model's tokenizer "
            "there (transformers' AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes "
            "it, as does jaxkv.models.byte_tokenizer().save(DIR))"
        )
    backend = HFTokenizer.from_file(str(file))
    vocab = backend.get_vocab(with_added_tokens=True)

    def first_present(*names):
        return next((vocab[n] for n in names if n in vocab), None)

    bos = first_present("<|bos|>", "<|begin_of_text|>", "<s>")
    eos = first_present("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>")
    pad = first_present("<|pad|>", "<pad>", "<|finetune_right_pad_id|>")
    return Tokenizer(
        backend=backend,
        bos_id=bos,
        eos_id=eos,
        pad_id=pad if pad is not None else (eos if eos is not None else 0),
    )
