"""Natural English prose that ships with Python itself: the paragraphs of the language reference
and library documentation in `pydoc_data.topics` (the text `help()` shows).

Real text, not generated, present wherever Python is, so benchmarks on a pretrained model can
build long haystacks without any download. Code samples, grammar rules and tables are left out:
only paragraphs of running text are kept, each re-flowed onto one line.
"""

from __future__ import annotations

import functools
import re

import numpy as np

_MIN_PARAGRAPH_CHARS = 200


def _is_running_text(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    if any(line.startswith((" ", "\t")) for line in lines):  # code, grammar, tables, quotes
        return False
    text = " ".join(lines)
    letters = sum(c.isalpha() or c == " " for c in text)
    return len(text) >= _MIN_PARAGRAPH_CHARS and letters > 0.9 * len(text) and "::=" not in text


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """Every running-text paragraph of the Python docs' topics, in a fixed order."""
    from pydoc_data.topics import topics

    found = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            if _is_running_text(block):
                found.append(" ".join(line.strip() for line in block.splitlines()))
    return tuple(dict.fromkeys(found))


def prose(num_chars: int, seed: int = 0) -> str:
    """At least `num_chars` characters of whole paragraphs (order shuffled by `seed`), joined by
    blank lines; a ValueError if the docs hold less."""
    pool = paragraphs()
    available = sum(len(p) + 2 for p in pool)
    if not 0 < num_chars <= available:
        raise ValueError(f"num_chars={num_chars}: the docs hold 1 to {available} characters")
    order = np.random.default_rng(seed).permutation(len(pool))
    chosen, total = [], 0
    for index in order:
        chosen.append(pool[index])
        total += len(pool[index]) + 2
        if total >= num_chars:
            break
    return "\n\n".join(chosen)
