"""Corpus selection and the retrieval episodes the trainer and the quality benchmark share."""

import numpy as np
import pytest

from jaxkv import tasks
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import pretrain


@pytest.fixture(scope="module")
def heldout():
    return corpus_lib.load_corpus("heldout")


def test_splits_are_disjoint_deterministic_and_nonempty():
    train, heldout = corpus_lib.corpus_files("train"), corpus_lib.corpus_files("heldout")
    assert train and heldout and not set(train) & set(heldout)
    assert 0.04 < len(heldout) / (len(train) + len(heldout)) < 0.2
    assert corpus_lib.split_of("json/decoder.py") == corpus_lib.split_of("json/decoder.py")
    assert all("test" not in path.parts for path in train + heldout)


def test_empty_corpus_and_bad_split_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no train text under"):
        corpus_lib.load_corpus("train", root=tmp_path)
    with pytest.raises(ValueError, match="split='dev'"):
        corpus_lib.corpus_files("dev")


def test_docstring_text_is_each_long_docstring_of_a_split_in_file_order(tmp_path):
    """`text="docstrings"` keeps the module, class and function docstrings of at least
    MIN_DOCSTRING_CHARS, dedented, joined by blank lines; code and short docstrings are left out."""
    long_doc = "Words about the module. " * 10
    names = [f"m{i}.py" for i in range(40) if corpus_lib.split_of(f"m{i}.py") == "train"][:2]
    (tmp_path / names[0]).write_text(
        f'"""{long_doc}"""\n\ndef f():\n    """Short."""\n    return 1\n\n\n'
        f'class C:\n    """{long_doc}\n\n    Second paragraph, indented."""\n'
    )
    (tmp_path / names[1]).write_text("x = 1  # no docstring at all\n")
    text = corpus_lib.load_corpus("train", root=tmp_path, text="docstrings").data.tobytes()
    paragraph = f"{long_doc}\n\nSecond paragraph, indented."
    assert text == f"{long_doc}\n\n{paragraph}".encode()
    source = corpus_lib.load_corpus("train", root=tmp_path).data.tobytes()
    assert b"return 1" in source and b"x = 1" in source
    with pytest.raises(ValueError, match="text='markdown': allowed are"):
        corpus_lib.load_corpus("train", root=tmp_path, text="markdown")


def test_stdlib_docstrings_are_mostly_prose():
    """The real split: hundreds of KB of English (letters and spaces), far more than code."""
    text = corpus_lib.load_corpus("heldout", text="docstrings").data.tobytes().decode()
    assert len(text) > 50_000
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.85 * len(text)


@pytest.mark.parametrize("kind", tasks.KINDS)
@pytest.mark.parametrize("length", [600, 2000])
def test_episode_has_its_exact_length_and_facts(heldout, kind, length):
    rng = np.random.default_rng(0)
    episode = tasks.make_episode(kind, heldout, rng, length)
    assert len(episode.prompt) == length
    assert episode.kind == kind
    value = episode.answer.split(b".")[0].split(b",")[0].strip()
    assert value.isdigit() and len(value) == 7
    assert episode.prompt.count(value) == 1  # stated once, in a fact, never in the question


def test_needle_depth_places_the_fact(heldout):
    rng = np.random.default_rng(1)
    for depth in (0.0, 0.5, 1.0):
        episode = tasks.needle(heldout, rng, 3000, depth=depth)
        where = episode.prompt.index(b"# The special magic number for") / len(episode.prompt)
        assert abs(where - depth) < 0.1


def test_vartrack_answer_follows_the_chain(heldout):
    episode = tasks.vartrack(heldout, np.random.default_rng(2), 2000, hops=3)
    lines = [line for line in episode.prompt.split(b"\n") if line.startswith(b"VAR_")]
    values = {}
    for line in lines:
        name, value = line.split(b" = ")
        values[name] = values.get(value, value)
    asked = episode.prompt.rsplit(b"Which number does ", 1)[1].split(b" ")[0]
    assert values[asked] + b"\n" == episode.answer


def test_too_short_prompt_is_a_clear_error(heldout):
    with pytest.raises(ValueError, match="too short for a multikey episode"):
        tasks.make_episode("multikey", heldout, np.random.default_rng(0), 200)
    with pytest.raises(ValueError, match="kind='poem'"):
        tasks.make_episode("poem", heldout, np.random.default_rng(0), 2000)


def test_batches_are_a_function_of_seed_and_step():
    recipe = pretrain.RECIPES["smoke"]
    text = corpus_lib.load_corpus("train")
    a, b = (pretrain.make_batch(recipe, text, 0, 3) for _ in range(2))
    c = pretrain.make_batch(recipe, text, 0, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["tokens"], c["tokens"])
    assert a["tokens"].shape == (8, 513) and a["weights"].shape == (8, 512)
    # Answer tokens carry the annealed extra weight; padding none.
    answer = a["answer"] > 0
    assert answer.any() and np.all(a["weights"][answer] > 1.0)
    assert np.all(a["weights"][a["tokens"][:, 1:] == pretrain.PAD] == 0.0)
