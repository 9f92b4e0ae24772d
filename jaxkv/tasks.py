"""Synthetic long-context retrieval episodes (in the spirit of RULER), as bytes.

Each episode is a prompt (haystack text with facts hidden at chosen depths, then a question) and
the answer the model must produce; scoring is exact match of the generated answer. The same
generators make training episodes (train split of the corpus, training seeds) and benchmark
episodes (held-out corpus, evaluation seeds).

Kinds:
  needle      one fact `The special magic number for <name> is <7 digits>.`, asked at the end;
  multikey    several such facts with different names, one asked;
  multivalue  several numbers for one name, all asked, in order of appearance;
  vartrack    `VAR_A = <number>`, later `VAR_B = VAR_A`, ...; the last variable's value asked.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("needle", "multikey", "multivalue", "vartrack")
# Longest answer any kind produces (multivalue with MAX_VALUES values), in bytes.
MAX_VALUES = 4
MAX_ANSWER_BYTES = MAX_VALUES * 9 + 2

_ADJECTIVES = (
    "amber azure bold brave bright calm clever crimson dusty eager fancy gentle golden happy "
    "hidden icy jolly lively lucky misty noble olive proud quiet rapid rusty silver sunny swift "
    "tidy violet witty"
).split()
_NOUNS = (
    "badger beacon canyon castle comet dragon falcon forest garden harbor island jaguar lantern "
    "meadow meteor orchid otter panda pepper planet puffin quartz raven river rocket salmon "
    "spider thunder tiger tulip walrus willow"
).split()


@dataclasses.dataclass(frozen=True)
class Episode:
    """prompt and answer bytes; depths (0-1) of the facts the answer depends on."""

    kind: str
    prompt: bytes
    answer: bytes
    depths: tuple[float, ...]


def _name(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        name = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if name not in taken:
            taken.add(name)
            return name


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _variable(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        name = "VAR_" + "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 4))
        if name not in taken:
            taken.add(name)
            return name


def _insert(haystack: bytes, facts: list[tuple[float, bytes]]) -> bytes:
    """Inserts each fact at the first line break at or after its depth (stable for ties)."""
    cuts = []
    for depth, fact in facts:
        position = int(depth * len(haystack))
        newline = haystack.find(b"\n", position)
        cuts.append((len(haystack) if newline < 0 else newline, fact))
    pieces, previous = [], 0
    for position, fact in sorted(cuts, key=lambda cut: cut[0]):
        pieces += [haystack[previous:position], fact]
        previous = position
    pieces.append(haystack[previous:])
    return b"".join(pieces)


def _episode(kind, corpus, rng, prompt_length, facts, question, answer, depths) -> Episode:
    facts_length = sum(len(fact) for _, fact in facts)
    haystack_length = prompt_length - facts_length - len(question)
    if haystack_length < 0:
        raise ValueError(
            f"prompt_length={prompt_length} is too short for a {kind} episode "
            f"(needs more than {facts_length + len(question)} bytes)"
        )
    prompt = _insert(corpus.text(rng, haystack_length), facts) + question
    return Episode(kind, prompt, answer, tuple(depths))


def needle(corpus, rng, prompt_length: int, depth: float | None = None, num_keys: int = 1):
    """One asked fact at `depth` (random if None) among `num_keys` facts."""
    taken: set[str] = set()
    names = [_name(rng, taken) for _ in range(num_keys)]
    values = [_number(rng) for _ in range(num_keys)]
    depth = float(rng.random()) if depth is None else depth
    depths = [depth] + [float(d) for d in rng.random(num_keys - 1)]
    facts = [
        (d, f"\n# The special magic number for {n} is {v}.\n".encode())
        for d, n, v in zip(depths, names, values, strict=True)
    ]
    question = (
        f"\n# What is the special magic number for {names[0]}? "
        f"The special magic number for {names[0]} is "
    ).encode()
    kind = "needle" if num_keys == 1 else "multikey"
    return _episode(
        kind, corpus, rng, prompt_length, facts, question, f"{values[0]}.\n".encode(), [depth]
    )


def multivalue(corpus, rng, prompt_length: int, num_values: int = 3):
    """`num_values` numbers for one name at random depths; all of them asked, in order."""
    if not 1 <= num_values <= MAX_VALUES:
        raise ValueError(f"num_values={num_values} must lie in [1, {MAX_VALUES}]")
    name = _name(rng, set())
    values = [_number(rng) for _ in range(num_values)]
    depths = sorted(float(d) for d in rng.random(num_values))
    facts = [
        (d, f"\n# One of the special magic numbers for {name} is {v}.\n".encode())
        for d, v in zip(depths, values, strict=True)
    ]
    question = (
        f"\n# What are all the special magic numbers for {name}? "
        f"The special magic numbers for {name} are "
    ).encode()
    answer = (", ".join(values) + ".\n").encode()
    return _episode("multivalue", corpus, rng, prompt_length, facts, question, answer, depths)


def vartrack(corpus, rng, prompt_length: int, hops: int = 2):
    """A chain VAR_1 = number, VAR_2 = VAR_1, ... (`hops` copies) at increasing depths."""
    taken: set[str] = set()
    names = [_variable(rng, taken) for _ in range(hops + 1)]
    value = _number(rng)
    depths = sorted(float(d) for d in rng.random(hops + 1))
    lines = [f"\n{names[0]} = {value}\n"] + [
        f"\n{names[i + 1]} = {names[i]}\n" for i in range(hops)
    ]
    facts = [(d, line.encode()) for d, line in zip(depths, lines, strict=True)]
    question = f"\n# Which number does {names[-1]} hold? {names[-1]} = ".encode()
    return _episode(
        "vartrack", corpus, rng, prompt_length, facts, question, f"{value}\n".encode(), depths
    )


def make_episode(kind: str, corpus, rng, prompt_length: int, **kwargs) -> Episode:
    """Dispatches on `kind` (one of KINDS); multikey defaults to 4 keys."""
    if kind == "needle":
        return needle(corpus, rng, prompt_length, **kwargs)
    if kind == "multikey":
        return needle(corpus, rng, prompt_length, num_keys=kwargs.pop("num_keys", 4), **kwargs)
    if kind == "multivalue":
        return multivalue(corpus, rng, prompt_length, **kwargs)
    if kind == "vartrack":
        return vartrack(corpus, rng, prompt_length, **kwargs)
    raise ValueError(f"kind={kind!r}: allowed are {KINDS}")
