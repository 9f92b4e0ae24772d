"""The real-model needle episodes and their scoring, shared by `jaxkv bench real_quality` and its
external reference (`kvpress_reference`), so that the two read the same token ids.

Episodes: natural prose from Python's own documentation (`jaxkv.prose`) as the haystack, with
7-digit "special magic number" needles at chosen depths, each a paragraph of its own; `needle`
hides one and asks for it, `multikey` hides six under different names and asks for one. The
prompt is the model's chat format: the haystack and then the question in one user turn, then
the assistant header and the answer prefix "The special magic number for NAME is". Scores:
exact match of the 7 digits, and the share of correct leading digits.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxkv.models import Tokenizer, chat_halves
from jaxkv.prose import prose

TASKS = ("needle", "multikey")
SETTINGS = ("aware", "agnostic")
MULTIKEY_KEYS = 6
DIGITS = 7
ANSWER_TOKENS = 10  # " " + 7 digits + "." + end of turn
EVAL_SEED = 20_000
# Keys are first names, no two alike: compound names that share a word (icy-otter, icy-meadow)
# are confused by the model with the full cache already, which would hide what policies lose.
_NAMES = (
    "Alice Bruno Clara Dmitri Elena Farid Greta Hiroshi Ingrid Javier Kofi Leila Marco Nadia "
    "Oscar Priya Quentin Rosa Stefan Tamara Ulrich Valeria Walter Yusuf"
).split()


@dataclasses.dataclass(frozen=True)
class TextEpisode:
    """context_ids: the chat prefix and the haystack; question_ids: the rest of the prompt (the
    question, end of turn, assistant header, answer prefix); answer: the digits asked for."""

    task: str
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answer: str
    depths: tuple[float, ...]


def _sentences(seed: int) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", prose(60_000, seed=seed))


def _haystack_text(sentences: list[str], needles: list[str]) -> str:
    """Filler sentences joined by spaces, each needle a paragraph of its own (the full cache
    finds 12/16 multikey answers at 2K so, 10/16 with needles inline: what policies lose
    should show against a full cache that finds them)."""
    text = " ".join(sentences)
    for needle in needles:
        text = text.replace(needle, f"\n\n{needle}\n\n")
    return re.sub(r" *\n\n *", "\n\n", text).strip()


def _question(tokenizer: Tokenizer, name: str, after: str) -> tuple[int, ...]:
    """The ids after the context: the question for `name`, end of turn, assistant header and
    the answer prefix."""
    question = (
        f"\n\nWhat is the special magic number for {name} mentioned in the text above?"
        f"{after}The special magic number for {name} is"
    )
    return tuple(tokenizer.encode(question, add_bos=False))


def _context_ids(
    tokenizer: Tokenizer, prefix_ids: list[int], needles, depths, seed: int, length: int
) -> list[int]:
    """The chat prefix, then prose with each needle at its depth: at most `length` tokens."""
    room = length - len(prefix_ids) - 16 * len(needles)
    haystack, used = [], 0
    for sentence in _sentences(seed=seed):
        cost = len(tokenizer.encode(" " + sentence, add_bos=False))
        if used + cost > room:
            break
        haystack.append(sentence)
        used += cost
    for depth, needle in sorted(zip(depths, needles, strict=True), reverse=True):
        haystack.insert(round(depth * len(haystack)), needle)
    context_ids = prefix_ids + tokenizer.encode(_haystack_text(haystack, needles), add_bos=False)
    while len(context_ids) > length:  # sentences tokenize apart differently
        last_filler = max(i for i, s in enumerate(haystack) if s not in needles)
        del haystack[last_filler]
        context_ids = prefix_ids + tokenizer.encode(
            _haystack_text(haystack, needles), add_bos=False
        )
    return context_ids


def _needles(names, numbers) -> list[str]:
    return [
        f"The special magic number for {n} is {v}." for n, v in zip(names, numbers, strict=True)
    ]


def build_episode(tokenizer: Tokenizer, task: str, length: int, index: int) -> TextEpisode:
    """Episode `index` of `task` with a prompt of at most `length` tokens (deterministic)."""
    rng = np.random.default_rng([EVAL_SEED, TASKS.index(task), length, index])
    keys = 1 if task == "needle" else MULTIKEY_KEYS
    names = [str(name) for name in rng.choice(_NAMES, keys, replace=False)]
    numbers = [str(rng.integers(10 ** (DIGITS - 1), 10**DIGITS)) for _ in names]
    asked = int(rng.integers(keys))
    if task == "needle":  # needles sweep the depths evenly over the episodes
        depths = [float((index * 0.618034) % 1.0)]
    else:
        depths = sorted(float(d) for d in rng.uniform(0, 1, keys))
    before, after = chat_halves(tokenizer)
    question_ids = _question(tokenizer, names[asked], after)
    context_ids = _context_ids(
        tokenizer,
        tokenizer.encode(before),
        _needles(names, numbers),
        depths,
        seed=int(rng.integers(1 << 30)),
        length=length - len(question_ids),
    )
    order = sorted(range(keys), key=lambda k: depths[k])
    return TextEpisode(
        task=task,
        context_ids=tuple(context_ids),
        question_ids=question_ids,
        answer=numbers[asked],
        depths=(depths[order.index(asked)] if task == "multikey" else depths[0],),
    )


@dataclasses.dataclass(frozen=True)
class Document:
    """One context with `keys` needles and a question for each: context_ids (the chat prefix
    and the haystack), questions (each one's ids, as `TextEpisode.question_ids`), answers."""

    context_ids: tuple[int, ...]
    questions: tuple[tuple[int, ...], ...]
    answers: tuple[str, ...]


def build_document(tokenizer: Tokenizer, length: int, keys: int, index: int = 0) -> Document:
    """Document `index` of about `length` context tokens with `keys` needles spread evenly in
    depth, every one asked (deterministic)."""
    rng = np.random.default_rng([EVAL_SEED, len(TASKS), length, keys, index])
    names = [str(name) for name in rng.choice(_NAMES, keys, replace=False)]
    numbers = [str(rng.integers(10 ** (DIGITS - 1), 10**DIGITS)) for _ in names]
    depths = [(k + 0.5) / keys for k in range(keys)]
    before, after = chat_halves(tokenizer)
    context_ids = _context_ids(
        tokenizer,
        tokenizer.encode(before),
        _needles(names, numbers),
        depths,
        seed=int(rng.integers(1 << 30)),
        length=length,
    )
    return Document(
        context_ids=tuple(context_ids),
        questions=tuple(_question(tokenizer, name, after) for name in names),
        answers=tuple(numbers),
    )


def score(tokenizer: Tokenizer, generated: np.ndarray, answer: str) -> tuple[bool, float]:
    """(exact match, share of correct leading digits) of a generated answer."""
    text = tokenizer.decode(generated)
    found = re.search(r"\d+", text)
    digits = found.group(0) if found else ""
    pairs = zip(digits, answer, strict=False)  # a wrong answer may have more or fewer digits
    leading = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    leading = min(len(digits), len(answer)) if leading is None else leading
    return digits == answer, leading / len(answer)
