"""Shared contexts with many questions (SCBench's shape, Li et al. 2024), generated offline from a
seed: one prose context (Python's docs, `jaxkv.prose`) holding facts of three kinds, then
questions of different tasks over it, for `jaxkv bench ruler_shared`:

  retrieval    RULER's needle "One of the special magic numbers for KEY is: VALUE." (four keys,
               one asked per question);
  multihop     a variable chain "VAR X = 12345", "VAR Y = VAR X", ... of four hops spread through
               the prose: every variable holding the value asked (RULER's vt);
  aggregation  a numbered list of words, three of them five times each and twelve once: the
               three most frequent asked (RULER's cwe in small).

Question q of context c is of kind QUESTION_KINDS[(q + c) % len(QUESTION_KINDS)], so over as many
contexts as kinds every position asks every kind equally. Scores are RULER's `string_match_all`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.benchmarks.ruler_tasks import (
    doc_words,
    essay_sentences,
    essay_words,
    insert_at_depths,
    needle_text,
    prompt_halves,
    random_value,
    string_match_all,
    variable_chain,
)
from jaxkv.models import Tokenizer

QUESTION_KINDS = (
    "retrieval",
    "multihop",
    "retrieval",
    "aggregation",
    "retrieval",
    "retrieval",
    "multihop",
    "aggregation",
)
ANSWER_TOKENS = 32
SEED = 7_400


@dataclasses.dataclass(frozen=True)
class SharedContext:
    """context_ids: the chat prefix and the context; questions: each question's ids (question,
    end of turn, assistant header, answer prefix); kinds and outputs per question."""

    index: int
    context_ids: tuple[int, ...]
    questions: tuple[tuple[int, ...], ...]
    kinds: tuple[str, ...]
    outputs: tuple[tuple[str, ...], ...]


def _facts(rng: np.random.Generator):
    """The context's facts (needles, chain lines, the list) and each kind's questions."""
    taken: set[str] = set()
    keys = [random_value(rng, "words", taken) for _ in range(4)]
    values = [random_value(rng, "numbers", taken) for _ in keys]
    needles = [needle_text("numbers", k, v) for k, v in zip(keys, values, strict=True)]
    names, chain, value = variable_chain(rng, hops=4, letters=5)
    vocabulary = doc_words()
    words = [vocabulary[i] for i in rng.choice(len(vocabulary), 15, replace=False)]
    listed = words[:3] * 5 + words[3:]
    listed = [listed[i] for i in rng.permutation(len(listed))]
    word_list = "Here is a numbered list of words: " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(listed)
    )
    retrieval = [
        (
            f"\nWhich special magic number for {k} does the text above mention?",
            f"The special magic number for {k} mentioned in the text above is",
            (v,),
        )
        for k, v in zip(keys, values, strict=True)
    ]
    multihop = (
        f"\nQuestion: Which variables are assigned the value {value} in the text above?",
        f"Answer: Following the assignments in the text above, 5 variables hold the value "
        f"{value}, namely:",
        tuple(names),
    )
    aggregation = (
        "\nQuestion: Which 3 words occur most often in the numbered list in the text above?",
        "Answer: The 3 words that occur most often in the list are:",
        tuple(words[:3]),
    )
    facts = [*needles, *(line + "." for line in chain), word_list]
    return facts, {"retrieval": retrieval, "multihop": [multihop], "aggregation": [aggregation]}


def build_shared_context(
    tokenizer: Tokenizer, length: int, index: int, questions: int = 6, seed: int = SEED
) -> SharedContext:
    """Context `index` with `questions` questions (1-8; SCBench asks 4-8): the most prose such
    that the context, its longest question and ANSWER_TOKENS fit `length` tokens
    (deterministic)."""
    if not 1 <= questions <= len(QUESTION_KINDS):
        raise ValueError(f"questions={questions}: 1 to {len(QUESTION_KINDS)}")
    before, after = prompt_halves(tokenizer)
    kinds = [QUESTION_KINDS[(q + index) % len(QUESTION_KINDS)] for q in range(questions)]

    def attempt(size: int):
        rng = np.random.default_rng([seed, length, index])
        facts, asked = _facts(rng)
        order = [facts[i] for i in rng.permutation(len(facts))]
        text = insert_at_depths(rng, essay_sentences(essay_words(rng), size), order)
        context = "Read the text below carefully: questions about it follow.\n" + text
        used = {kind: 0 for kind in asked}
        chosen = []
        for kind in kinds:
            question, prefix, outputs = asked[kind][used[kind] % len(asked[kind])]
            used[kind] += 1
            ids = tokenizer.encode(question + after + prefix, add_bos=False)
            chosen.append((tuple(ids), outputs))
        context_ids = tokenizer.encode(before) + tokenizer.encode(context, add_bos=False)
        longest = max(len(ids) for ids, _ in chosen)
        return len(context_ids) + longest + ANSWER_TOKENS <= length, context_ids, chosen

    low, high = 16, 32
    if not attempt(low)[0]:
        raise ValueError(f"{length} tokens cannot hold a shared context and its questions")
    while attempt(high)[0]:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if attempt(middle)[0] else (low, middle)
    _, context_ids, chosen = attempt(low)
    return SharedContext(
        index=index,
        context_ids=tuple(context_ids),
        questions=tuple(ids for ids, _ in chosen),
        kinds=tuple(kinds),
        outputs=tuple(outputs for _, outputs in chosen),
    )


def score(prediction: str, outputs) -> float:
    """RULER's string_match_all of one answer."""
    return string_match_all(prediction, outputs)
