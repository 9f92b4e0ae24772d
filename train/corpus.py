"""Natural text that exists on every machine: the Python standard library's own source files.

Files are selected deterministically (sorted relative paths under the stdlib directory, tests,
site-packages and IDLE left out) and split by a hash of the relative path, so the same file is
always in the same split on any machine. The text differs slightly between Python versions; the
split does not. A split's text is either the files as they are (`source`) or only their English
prose (`docstrings`: the module, class and function docstrings of at least
`MIN_DOCSTRING_CHARS`, in file order), for models whose gates should learn what matters in prose.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from jaxkv.models.tokenizer import (
    Tokenizer,
    is_byte_tokenizer,
    max_token_bytes,
    token_ids_of_bytes,
)

SPLITS = ("train", "heldout")
TEXTS = ("source", "docstrings")
MIN_DOCSTRING_CHARS = 200
HELDOUT_PERCENT = 10
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """ "heldout" for about HELDOUT_PERCENT% of paths, chosen by SHA-256, else "train"."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return "heldout" if int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT else "train"


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """The sorted source files of one split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: allowed are {SPLITS}")
    root = stdlib_root() if root is None else root
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if (
            _EXCLUDED_DIRS.isdisjoint(relative.parts[:-1])
            and split_of(relative.as_posix()) == split
        ):
            files.append(path)
    return files


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The bytes of one split, files joined by blank lines; uint8 [num_bytes]."""

    data: np.ndarray
    split: str

    def text(self, rng: np.random.Generator, length: int) -> bytes:
        """`length` bytes starting at a random line start."""
        if length > len(self.data):
            raise ValueError(f"length={length} exceeds the {self.split} corpus ({len(self.data)})")
        start = int(rng.integers(0, len(self.data) - length + 1))
        newline = np.flatnonzero(self.data[start : start + 256] == ord("\n"))
        if newline.size and start + newline[0] + 1 + length <= len(self.data):
            start += int(newline[0]) + 1
        return self.data[start : start + length].tobytes()

    def token_ids(self, rng: np.random.Generator, tokenizer: Tokenizer, count: int) -> np.ndarray:
        """int32 [count] ids of text from a random line start, in `tokenizer`'s vocabulary: the
        byte-level tokenizer's are `text`'s bytes; for another, enough bytes that `count` tokens
        surely fit (`max_token_bytes`) are encoded and the first `count` kept, or from a corpus
        shorter than that a quarter of it (a ValueError if those bytes hold too few tokens)."""
        byte_level = is_byte_tokenizer(tokenizer)
        needed = count if byte_level else (count + 1) * max_token_bytes(tokenizer)
        if not byte_level and needed > len(self.data):
            needed = len(self.data) // 4
        ids = token_ids_of_bytes(tokenizer, self.text(rng, needed))
        if len(ids) < count:
            raise ValueError(f"{needed} bytes of {self.split} text gave {len(ids)} < {count} ids")
        return np.asarray(ids[:count], np.int32)


def docstrings(source: bytes, path: Path) -> list[bytes]:
    """The docstrings of at least MIN_DOCSTRING_CHARS of one module (its own, its classes' and
    functions'), in the order `ast.walk` visits them, cleaned of their indentation."""
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                found.append(doc.encode())
    return found


def add_text_argument(
    parser: argparse.ArgumentParser, default: str | None = "source", note: str = ""
) -> None:
    """`--text`, one of TEXTS, for the trainers that read this corpus."""
    parser.add_argument(
        "--text",
        choices=TEXTS,
        default=default,
        help="the corpus's text: the files' source or their docstrings" + note,
    )


def load_corpus(split: str, root: Path | None = None, text: str = "source") -> Corpus:
    """One split's `text` (TEXTS), files (or docstrings) joined by blank lines."""
    if text not in TEXTS:
        raise ValueError(f"text={text!r}: allowed are {TEXTS}")
    files = corpus_files(split, root)
    if text == "source":
        chunks = [path.read_bytes() for path in files]
    else:
        chunks = [doc for path in files for doc in docstrings(path.read_bytes(), path)]
    if not chunks or not any(chunks):
        raise ValueError(
            f"no {split} text under {stdlib_root() if root is None else root}: the corpus needs "
            "the Python standard library's .py sources"
        )
    data = np.frombuffer(b"\n\n".join(chunks), np.uint8)
    return Corpus(data, split)
