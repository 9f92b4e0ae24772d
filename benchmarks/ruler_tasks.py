"""RULER's synthetic tasks (Hsieh et al. 2024, NVIDIA/RULER), generated offline from a seed, and
RULER's scores: pure functions shared by `jaxkv bench ruler`, its shared-context suite and the
kvpress side (`kvpress_reference --ruler`), so that every side reads the same token ids.

The task definitions follow RULER's `scripts/synthetic.yaml` and its generators (docs/ruler.md,
docs/references.md); the code and the prompts' wording are jaxkv's own:

  niah_single_1/2/3   one needle "One of the special magic {numbers|uuids} for KEY is: VALUE."
                      in a noise haystack (1), or in prose (2: number values, 3: UUID values);
  niah_multikey_1     four needles with different keys in prose, one asked;
  niah_multikey_2/3   the haystack is itself needles with other keys (2: word keys, number
                      values; 3: UUID keys and values), one asked;
  niah_multivalue     four values of one key, all asked;
  niah_multiquery     four keys, all four asked in one question;
  vt                  variable tracking: one chain "VAR X = 12345", "VAR Y = VAR X", ... of four
                      hops in noise, after a one-shot example; every variable of the chain asked;
  cwe                 common words: a numbered list where 10 words appear 30 times and the rest
                      3 times (6 / 1 below 4K), after a one-shot example; the 10 asked;
  fwe                 frequent words: coded words drawn from a Zipf law (alpha 2), the top
                      one '...' is noise; the next three asked.

Left out: RULER's QA tasks (qa_1 SQuAD, qa_2 HotpotQA) need downloaded datasets. Differences
from RULER, all because nothing may be downloaded: the prose haystack ("essay") is Python's own
documentation (`jaxkv.prose`), not Paul Graham's essays; word keys are adjective-noun pairs from
the small lists below, not wonderwords'; CWE's words are the lowercase words of that
documentation (1.5K of them). Sizes are fitted as RULER fits them: the largest haystack whose
prompt, with the task's answer tokens, fits the context length in the model's tokenizer.

Scores (RULER's `string_match_all`): the share of the references found in the prediction,
case-insensitive. The runs' shape, shared by every side: kvpress's compression ratios, the two
settings and the presses its leaderboard runs query-aware (`cells`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import uuid
from collections.abc import Callable

import numpy as np

from jaxkv.models import Tokenizer, chat_halves
from jaxkv.prose import paragraphs

NIAH_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
)
TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe")
# RULER's tokens_to_generate per task family.
ANSWER_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
DEFAULT_SEED = 42
RATIOS = (0.25, 0.5, 0.75, 0.875)  # kvpress's leaderboard: the share of the prompt evicted
SETTINGS = ("agnostic", "aware")
AWARE_POLICIES = ("snapkv", "adakv", "finch", "chunkkv")  # kvpress's leaderboard.sh
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER's needle depths: 40 evenly spaced percentages, drawn without replacement.
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))


@dataclasses.dataclass(frozen=True)
class NiahSpec:
    """One NIAH task of RULER's table: haystack kind, key and value kinds, and counts."""

    haystack: str  # "noise", "essay" or "needle"
    keys: str  # "words", "numbers" or "uuids"
    values: str  # "numbers" or "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_queries=4),
}

# Word keys are ADJECTIVE-NOUN (RULER draws them from wonderwords' lists, a download here).
ADJECTIVES = (
    "able acid agile airy amber ample ancient angry arctic ashen awful bald bare bitter bland "
    "blunt bold bouncy brave brief bright brisk broad bumpy busy calm candid cheap chilly civil "
    "clever cloudy clumsy coarse cozy crisp cruel curly damp dapper dark dear deep dense dizzy "
    "dreary dusty eager early earthy easy elder empty faint fancy fierce filthy flaky fluffy "
    "fond frail frank fresh frosty frozen fuzzy gentle giant giddy glad gloomy glossy golden "
    "grand greasy greedy grim gritty grumpy hairy handy happy hasty hazy hearty heavy hollow "
    "honest humble hungry icy idle jolly juicy keen kind lame lanky large lazy lean little "
    "lively lofty lonely loud lucky lumpy mellow merry messy mighty misty modest moist muddy "
    "murky naive narrow nasty neat nervous nimble noble noisy numb oily orange pale plain plump "
    "polite proud quaint quick quiet rapid rare raw ripe rough round rowdy royal rusty sandy "
    "scary shabby shaky sharp shiny shy silent silky silly simple sleepy slim slow smoky smooth "
    "snowy soft solid sour spicy stale steady steep sticky stormy strict sturdy sunny sweet swift "
    "tall tame tart tender tense tidy tiny tough tricky vast vivid warm wary weary wet wide wild "
    "windy wise witty wooden young zany zealous"
).split()
NOUNS = (
    "acorn anchor apple arch attic badge badger bagel banjo barn basket beacon beetle bell bench "
    "biscuit blanket bonnet bottle boulder bracket bridge broom bucket bugle butter cabin cactus "
    "camel candle canoe canyon carpet castle cellar chalk cherry chimney cider cliff clock "
    "cobweb comet compass copper cottage crayon cricket crown cushion dagger daisy desert dolphin "
    "donkey dragon drum eagle easel elbow engine falcon feather fence ferret fiddle flute forest "
    "fossil fountain garden garlic geyser ginger glacier goblet goose gravel hammer harbor "
    "harp hedge helmet hermit hippo hornet iceberg igloo island ivory jacket jaguar jelly kettle "
    "kitten ladder lagoon lantern lemon lizard locket magnet mango maple meadow mitten moose "
    "mortar muffin napkin needle nutmeg oasis oboe orchid otter oyster paddle panda parrot "
    "pebble pelican pepper piano pickle pigeon pillow pine planet pocket pony puddle puffin "
    "pumpkin quartz quilt rabbit radish raven ribbon river rocket saddle salmon sandal scarf "
    "shovel spider spoon squid statue stool tavern teapot thimble thistle tiger tomato trumpet "
    "tulip turnip turtle umbrella valley velvet violin wagon walnut walrus whistle willow window "
    "wizard yogurt zebra"
).split()


@dataclasses.dataclass(frozen=True)
class Parts:
    """A sample as text: `context` is what a query-agnostic run compresses (the instructions,
    any one-shot example and the haystack), `question` follows it, `answer_prefix` opens the
    assistant's turn, `outputs` are the references scored."""

    context: str
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample in a model's tokens. context_ids: the chat prefix and the context (what the
    query-agnostic setting compresses); question_ids: the question, the end of the user turn,
    the assistant header and the answer prefix, its first `question_turn_tokens` the question
    itself (what the query-aware setting compresses with the context: kvpress's pipeline reads
    the rest after the compression in both settings); max_new_tokens: RULER's answer tokens;
    size: the haystack units the fit chose (noise blocks, words, distractor needles or list
    words)."""

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    question_turn_tokens: int
    max_new_tokens: int
    size: int

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus the answer's: at most the context length asked for."""
        return len(self.context_ids) + len(self.question_ids) + self.max_new_tokens

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def split(self, setting: str) -> tuple[list[int], list[int]]:
        """(what `setting` compresses, what is read after it): agnostic the context, then the
        question; aware the context and the question itself, then the end of the user turn,
        the assistant header and the answer prefix (`question_turn_tokens`)."""
        prompt = self.context_ids + self.question_ids
        cut = len(self.context_ids) + (self.question_turn_tokens if setting == "aware" else 0)
        return list(prompt[:cut]), list(prompt[cut:])

    def capped(self, cap: int | None) -> Sample:
        """The sample with at most `cap` answer tokens (None: as it is)."""
        if cap is None:
            return self
        return dataclasses.replace(self, max_new_tokens=min(cap, self.max_new_tokens))


def cells(entries: dict[str, str], ratios, settings, aware_policies):
    """(entry, ratio, setting) in run order for `entries` ({entry: its policy's name}):
    setting, ratio, then entry; the full cache once, as ratio 0 agnostic (it answers the same
    in both); in the aware setting only the policies of `aware_policies`."""
    full = [entry for entry, name in entries.items() if name == "full"]
    if full:
        yield full[0], 0.0, "agnostic"
    for setting in settings:
        for ratio in ratios:
            for entry, name in entries.items():
                if name != "full" and (setting == "agnostic" or name in aware_policies):
                    yield entry, ratio, setting


# ------------------------------------------------------------------------------ scoring


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a prediction: control characters become line breaks, ends stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references) -> float:
    """The share (0-1) of `references` found in `prediction`, case-insensitive (RULER's score of
    the synthetic tasks, before its x100)."""
    text = prediction.lower()
    return sum(r.lower() in text for r in references) / len(references)


def prediction(tokenizer: Tokenizer, tokens, stop) -> str:
    """RULER's prediction from generated `tokens`: those before the first of `stop`, decoded,
    `postprocess`ed."""
    kept = []
    for token in (int(t) for t in tokens):
        if token in stop:
            break
        kept.append(token)
    return postprocess(tokenizer.decode(kept))


def answer_token_span(tokenizer: Tokenizer, sample: Sample, output: str) -> range:
    """The indices into `sample.context_ids` of the tokens that spell `output` (one of its
    answers), which the context must hold exactly once (a needle's value); ValueError
    otherwise. Found by characters: binary searches over the decoded prefixes' lengths."""
    ids = list(sample.context_ids)
    text = tokenizer.decode(ids)
    if text.count(output) != 1:
        raise ValueError(
            f"{sample.task} #{sample.index}: its answer {output!r} is in the context "
            f"{text.count(output)} times, not once (the niah tasks' needles are)"
        )
    start = text.index(output)

    def tokens_reaching(chars: int) -> int:  # the fewest tokens whose text has `chars` chars
        low, high = 0, len(ids)
        while low < high:
            middle = (low + high) // 2
            if len(tokenizer.decode(ids[:middle])) >= chars:
                high = middle
            else:
                low = middle + 1
        return low

    return range(tokens_reaching(start + 1) - 1, tokens_reaching(start + len(output)))


# ------------------------------------------------------------------------------ haystacks


@functools.cache
def doc_words() -> tuple[str, ...]:
    """The distinct lowercase words (4-12 letters) of Python's docs prose, sorted: CWE's words."""
    found = set()
    for paragraph in paragraphs():
        found.update(re.findall(r"(?<![\w.-])[a-z]{4,12}(?![\w-])", paragraph))
    return tuple(sorted(found))


def essay_words(rng: np.random.Generator) -> list[str]:
    """Every docs paragraph once, in an order drawn from `rng`, as words."""
    pool = paragraphs()
    return " ".join(pool[i] for i in rng.permutation(len(pool))).split()


def essay_sentences(words: list[str], count: int) -> list[str]:
    """The first `count` words (the text repeated as RULER repeats its essays) as sentences."""
    repeats = -(-count // len(words))
    text = " ".join((words * repeats)[:count])
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def insert_at_depths(rng, sentences: list[str], needles: list[str]) -> str:
    """Needles between sentences at depths drawn from DEPTHS without replacement, in order."""
    depths = sorted(int(d) for d in rng.choice(DEPTHS, len(needles), replace=False))
    cuts = [0] + [len(sentences) * d // 100 for d in depths] + [len(sentences)]
    pieces = []
    for i in range(1, len(cuts)):
        pieces.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(needles):
            pieces.append(needles[i - 1])
    return " ".join(p for p in pieces if p)


def _insert_lines(rng, lines: list[str], inserted: list[str]) -> str:
    """`inserted` among `lines`, in their order, at positions drawn without replacement (with
    it when there are fewer slots than lines to insert)."""
    slots = len(lines) + 1
    drawn = rng.choice(slots, len(inserted), replace=len(inserted) > slots)
    positions = sorted(int(p) for p in drawn)
    out = list(lines)
    for offset, (position, line) in enumerate(zip(positions, inserted, strict=True)):
        out.insert(position + offset, line)
    return "\n".join(out)


def random_value(rng: np.random.Generator, kind: str, taken: set[str]) -> str:
    while True:
        if kind == "numbers":
            value = str(int(rng.integers(1_000_000, 10_000_000)))
        elif kind == "words":
            value = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        elif kind == "uuids":
            value = str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))
        else:
            raise ValueError(f"kind={kind!r}: numbers, words or uuids")
        if value not in taken:
            taken.add(value)
            return value


def needle_text(kind: str, key: str, value: str) -> str:
    """RULER's needle sentence."""
    return f"One of the special magic {kind} for {key} is: {value}."


# ------------------------------------------------------------------------------ tasks


def niah(spec: NiahSpec, rng: np.random.Generator, size: int) -> Parts:
    """A NIAH sample with `size` haystack units (noise blocks, words or distractor needles)."""
    taken: set[str] = set()
    num_keys = max(spec.num_keys, spec.num_queries)
    if (
        spec.haystack == "needle"
        and spec.keys == "words"
        and size > len(ADJECTIVES) * len(NOUNS) // 2
    ):
        raise ValueError(
            f"{size} distractor needles: the word keys allow {len(ADJECTIVES) * len(NOUNS) // 2}"
        )
    keys = [random_value(rng, spec.keys, taken) for _ in range(num_keys)]
    values = [[random_value(rng, spec.values, taken) for _ in range(spec.num_values)] for _ in keys]
    needles = [
        needle_text(spec.values, k, v) for k, vs in zip(keys, values, strict=True) for v in vs
    ]
    needles = [needles[i] for i in rng.permutation(len(needles))]
    asked = sorted(int(i) for i in rng.choice(num_keys, spec.num_queries, replace=False))
    if spec.haystack == "essay":
        haystack = insert_at_depths(rng, essay_sentences(essay_words(rng), size), needles)
    elif spec.haystack == "noise":
        haystack = _insert_lines(rng, [NOISE] * size, needles)
    else:  # the haystack is needles of other keys, with other values
        distractors = [
            needle_text(
                spec.values,
                random_value(rng, spec.keys, taken),
                random_value(rng, spec.values, taken),
            )
            for _ in range(size)
        ]
        haystack = _insert_lines(rng, distractors, needles)
    query = ", ".join(keys[i] for i in asked[:-1])
    query = f"{query}, and {keys[asked[-1]]}" if len(asked) > 1 else keys[asked[0]]
    single = spec.num_queries * spec.num_values == 1
    kind = spec.values[:-1] if single else spec.values
    intro = (
        f"A special magic {kind} is hidden in the text below. Memorize it: you will be asked "
        f"about the {kind} afterwards."
        if single
        else f"Special magic {kind} are hidden in the text below. Memorize them: you will be "
        f"asked about the {kind} afterwards."
    )
    verb = "is" if single else "are"
    return Parts(
        context=f"{intro}\n{haystack}",
        question=f"\nWhich special magic {kind} for {query} does the text above mention?",
        answer_prefix=f"The special magic {kind} for {query} mentioned in the text above {verb}",
        outputs=tuple(v for i in asked for v in values[i]),
    )


def variable_chain(
    rng: np.random.Generator, hops: int, letters: int
) -> tuple[list[str], list[str], str]:
    """(variable names, assignment lines, value) of one chain of `hops` copies."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), letters))
        if name not in names:
            names.append(name)
    value = str(int(rng.integers(10_000, 100_000)))
    lines = [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(hops)
    ]
    return names, lines, value


def _vt_text(rng, size: int, hops: int, letters: int) -> tuple[str, str, str, list[str]]:
    names, lines, value = variable_chain(rng, hops, letters)
    context = (
        "Follow the chains of variable assignments hidden in the text below and remember "
        "them.\n\n" + _insert_lines(rng, [NOISE] * size, lines)
    )
    question = f"\nQuestion: Which variables are assigned the value {value} in the text above?"
    prefix = (
        f"Answer: Following the assignments in the text above, {hops + 1} variables hold the "
        f"value {value}, namely:"
    )
    return context, question, prefix, names


def vt(rng: np.random.Generator, size: int, hops: int = 4, example_size: int = 8) -> Parts:
    """Variable tracking: a one-shot example (3-letter names), then one chain of `hops` copies
    among `size` noise blocks; every variable holding the value asked."""
    shot = _vt_text(rng, example_size, hops, letters=3)
    context, question, prefix, names = _vt_text(rng, size, hops, letters=5)
    example = f"{shot[0]}{shot[1]}\n{shot[2]} {' '.join(shot[3])}\n"
    return Parts(f"{example}\n{context}", question, prefix, tuple(names))


def _cwe_text(rng, words: list[str], common: int, repeats: int, rare_repeats: int):
    listed = words[:common] * repeats + words[common:] * rare_repeats
    listed = [listed[i] for i in rng.permutation(len(listed))]
    numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
    context = (
        "The numbered list below repeats some words more often than others. Remember the most "
        f"frequent ones.\n{numbered}"
    )
    question = f"\nQuestion: Which {common} words occur most often in the list above?"
    prefix = f"Answer: The {common} words that occur most often in the list are:"
    return context, question, prefix, words[:common]


def cwe(rng: np.random.Generator, size: int, long: bool = True, common: int = 10) -> Parts:
    """Common words: `size` distinct words, `common` of them repeated 30 times and the rest 3
    (6 and 1 when not `long`, RULER's choice below 4K), after a one-shot example (40 words at
    10 / 3, or 20 at 3 / 1)."""
    vocabulary = doc_words()
    shot_size, shot_reps = (40, (10, 3)) if long else (20, (3, 1))
    if shot_size + size > len(vocabulary):
        raise ValueError(f"cwe: {size} words asked, the docs hold {len(vocabulary) - shot_size}")
    chosen = [vocabulary[i] for i in rng.choice(len(vocabulary), shot_size + size, replace=False)]
    shot = _cwe_text(rng, chosen[:shot_size], common, *shot_reps)
    reps = (30, 3) if long else (6, 1)
    context, question, prefix, answer = _cwe_text(rng, chosen[shot_size:], common, *reps)
    shown = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot[3]))
    example = f"{shot[0]}{shot[1]}\n{shot[2]} {shown}\n"
    return Parts(f"{example}\n{context}", question, prefix, tuple(answer))


def fwe(rng: np.random.Generator, size: int, vocab_size: int, alpha: float = 2.0) -> Parts:
    """Frequent words: `size` draws' worth of 6-letter coded words, word k of the vocabulary
    appearing floor(size k^-alpha / zeta(alpha)) times; word 1 is '...' (noise), 2-4 asked."""
    vocabulary: list[str] = []
    while len(vocabulary) < vocab_size:
        word = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6))
        if word not in vocabulary:
            vocabulary.append(word)
    vocabulary[0] = "..."
    zeta = sum(k**-alpha for k in range(1, 100_000)) + 100_000 ** (1 - alpha) / (alpha - 1)
    counts = [math.floor(size * k**-alpha / zeta) for k in range(1, vocab_size + 1)]
    text = [w for w, c in zip(vocabulary, counts, strict=True) for _ in range(c)]
    text = [text[i] for i in rng.permutation(len(text))]
    return Parts(
        context="Read the coded text below and count how often each coded word occurs: find the "
        "three most frequent coded words. " + " ".join(text),
        question="\nQuestion: Answer without explanation, ignoring the dots '....'. Which three "
        "words occur most often in the coded text above?",
        answer_prefix="Answer: In the coded text above, the three most frequent words are:",
        outputs=tuple(vocabulary[1:4]),
    )


def family(task: str) -> str:
    """RULER's task family of `task`: niah, vt, cwe or fwe."""
    if task in NIAH:
        return "niah"
    if task in ("vt", "cwe", "fwe"):
        return task
    raise ValueError(f"task {task!r}: RULER's synthetic tasks here are {TASKS}")


def generator(task: str, length: int) -> Callable[[np.random.Generator, int], Parts]:
    """`(rng, size) -> Parts` of `task` for a context of `length` tokens."""
    kind = family(task)
    if kind == "niah":
        return functools.partial(niah, NIAH[task])
    if kind == "vt":  # a shorter one-shot example below 4K
        return functools.partial(vt, example_size=8 if length >= 4096 else 2)
    if kind == "cwe":
        return functools.partial(cwe, long=length >= 4096)
    return functools.partial(fwe, vocab_size=max(8, (length - ANSWER_TOKENS["fwe"]) // 50))


# ------------------------------------------------------------------------------ samples


def prompt_halves(tokenizer: Tokenizer) -> tuple[str, str]:
    """The chat text around one user message (`chat_halves`), or for a model without a chat
    template none before and a line break after."""
    if tokenizer.chat_template is None:
        return "", "\n"
    return chat_halves(tokenizer)


def _tokens(tokenizer: Tokenizer, parts: Parts) -> tuple[list[int], list[int], int]:
    """(context_ids, question_ids, question_turn_tokens) of `Sample`; ValueError if the
    tokenizer merges the question's last characters with the text after it (the query-aware
    setting could not read that text apart)."""
    before, after = prompt_halves(tokenizer)
    context_ids = tokenizer.encode(before) + tokenizer.encode(parts.context, add_bos=False)
    question_ids = tokenizer.encode(parts.question + after + parts.answer_prefix, add_bos=False)
    question_turn = tokenizer.encode(parts.question, add_bos=False)
    if question_ids[: len(question_turn)] != question_turn:
        raise ValueError(
            f"the tokenizer merges the question's end {parts.question[-20:]!r} with what follows "
            f"it ({after + parts.answer_prefix!r}): no token boundary for the query-aware split"
        )
    return context_ids, question_ids, len(question_turn)


def build_sample(
    tokenizer: Tokenizer, task: str, length: int, index: int, seed: int = DEFAULT_SEED
) -> Sample:
    """Sample `index` of `task`: the largest haystack whose prompt and answer tokens fit in
    `length` tokens (a binary search over its size, as RULER fits it); deterministic in (seed,
    task, length, index). ValueError if even the smallest haystack does not fit."""
    make = generator(task, length)
    answer_tokens = ANSWER_TOKENS[family(task)]

    def attempt(size: int):
        rng = np.random.default_rng([seed, TASKS.index(task), length, index])
        parts = make(rng, size)
        context_ids, question_ids, question_turn = _tokens(tokenizer, parts)
        fits = len(context_ids) + len(question_ids) + answer_tokens <= length
        return fits, parts, context_ids, question_ids, question_turn

    low = 1 if family(task) != "fwe" else 64
    if not attempt(low)[0]:
        raise ValueError(f"{task}: {length} tokens cannot hold its smallest prompt and answer")
    high = low * 2
    while attempt(high)[0]:
        low, high = high, high * 2
    while high - low > 1:  # attempt(low) fits, attempt(high) does not
        middle = (low + high) // 2
        low, high = (middle, high) if attempt(middle)[0] else (low, middle)
    _, parts, context_ids, question_ids, question_turn = attempt(low)
    return Sample(
        task=task,
        index=index,
        context=parts.context,
        question=parts.question,
        answer_prefix=parts.answer_prefix,
        outputs=parts.outputs,
        context_ids=tuple(context_ids),
        question_ids=tuple(question_ids),
        question_turn_tokens=question_turn,
        max_new_tokens=answer_tokens,
        size=low,
    )


def sample_from_json(record: dict) -> Sample:
    """A `Sample` from `Sample.to_json`'s dict (the exported samples file's lines)."""
    fields = {f.name for f in dataclasses.fields(Sample)}
    missing = sorted(fields - set(record))
    if missing:
        raise ValueError(
            f"sample {record.get('task')} #{record.get('index')} lacks {missing}: an older "
            "export; delete the samples file (it is written again from the seed)"
        )
    values = {k: v for k, v in record.items() if k in fields}
    for name in ("outputs", "context_ids", "question_ids"):
        values[name] = tuple(values[name])
    return Sample(**values)
