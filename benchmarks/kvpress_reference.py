"""The external reference for `jaxkv bench real_quality`: kvpress 0.5.5's presses on the same
episodes (the same token ids), through transformers' GGUF loading of the same file.

kvpress's pipeline is reproduced step by step with its public press API:
  agnostic  the context (up to the end of the haystack) is prefilled under the press, then the
            question is read over the compressed cache and the answer decoded greedily, without
            the press (kvpress's `KVPressTextGenerationPipeline`);
  aware     the whole prompt, question included, is prefilled under the press (kvpress's
            evaluation with `compress_questions`), then the answer decoded greedily.
After a press that rotates its n kept keys to positions 0..n-1 (KeyRerotationPress, FinchPress)
the rest is read from position n, as the pipeline reads on from `cache.get_seq_length()`.
kvpress's compression_ratio is the share removed: jaxkv's budget b is kvpress's 1 - b. Scores,
intervals and the table are `real_quality`'s, so the two files compare cell by cell.

Needs the kvpress extra in an environment of its own (kvpress pins transformers < 5.3):

    python -m venv .venv-kvpress && . .venv-kvpress/bin/activate
    pip install -e '.[kvpress]'
    python -m jaxkv.benchmarks.kvpress_reference --presses snapkv streaming_llm tova \\
        --budgets 0.3 --samples 16 --out results/real-quality/needles-2k/kvpress

--reuse is the reference of `jaxkv bench reuse` (compress once, ask many): its document
(`needles.build_document`, one needle per question) through kvpress's own
`KVPressTextGenerationPipeline`, `pipe(context, questions=[...], press=...)`, once per press: the
context prefilled under the press, then each question answered greedily over the compressed
cache, which is cut back to the context after each answer. Only the pipeline's `preprocess`
(chat template and tokenizing) is replaced, by the document's token ids as they are: kvpress takes
one answer prefix for all questions, and each question here ends with its own ("The special
magic number for NAME is"). Writes OUT/MODEL/reuse-kvpress.json (and .md):

    python -m jaxkv.benchmarks.kvpress_reference --reuse --budgets 0.3 --lengths 2048 \\
        --questions 8 --out results/reuse/kvpress

--ruler SAMPLES.jsonl is the kvpress side of `jaxkv bench ruler`: the samples it exported (their
token ids) through each press at kvpress's compression ratios (`--ratios`, the share evicted),
agnostic (the context prefilled under the press, then the question) and, for the presses of
`ruler_tasks.AWARE_POLICIES`, aware (the context and the question under the press, then the end
of the user turn, the assistant header and the answer prefix, as kvpress's pipeline splits
them); each answer decoded greedily for the task's answer tokens and scored by RULER's rule
(`ruler_tasks.prediction`, `string_match_all`). Records as
`jaxkv bench ruler` writes them (OUT/records.jsonl, resumable), so `jaxkv bench ruler --render
--against OUT/records.jsonl` tables jaxkv minus kvpress:

    python -m jaxkv.benchmarks.kvpress_reference \\
        --ruler results/ruler/smollm2-135m-instruct-4k/samples.jsonl \\
        --presses full snapkv streaming_llm --ratios 0.5 \\
        --out results/ruler/smollm2-135m-instruct-4k/kvpress
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv import downloads
from jaxkv.benchmarks import harness, ruler_tasks
from jaxkv.benchmarks.needles import (
    ANSWER_TOKENS,
    SETTINGS,
    TASKS,
    Document,
    build_document,
    build_episode,
    score,
)
from jaxkv.benchmarks.real_quality_report import cell_key, markdown_table
from jaxkv.benchmarks.ruler_report import (
    KVPRESS_VARIANTS,
    append_record,
    load_records,
    read_jsonl,
    record_key,
)
from jaxkv.benchmarks.ruler_tasks import prediction, sample_from_json, string_match_all
from jaxkv.models import gguf_tokenizer

# jaxkv's policy name -> kvpress 0.5.5's press class.
PRESSES = {
    "snapkv": "SnapKVPress",
    "streaming_llm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "expected_attention": "ExpectedAttentionPress",
    "pyramidkv": "PyramidKVPress",
    "kvzip": "KVzipPress",
    "observed_attention": "ObservedAttentionPress",
    "keydiff": "KeyDiffPress",
    "lagkv": "LagKVPress",
    "cur": "CURPress",
    "cap": "CapPress",
    "leverage": "LeverageScorePress",
    "compactor": "CompactorPress",
    "kvcompose": "KVComposePress",
    "kvgrad": "KVgradPress",
}
# jaxkv's wrapping policies -> (kvpress's wrapper, the press it wraps: jaxkv's default `inner`).
WRAPPERS = {
    "chunkkv": ("ChunkKVPress", "SnapKVPress"),
    "adakv": ("AdaKVPress", "SnapKVPress"),
    "chunk": ("ChunkPress", "KeyDiffPress"),
    "block": ("BlockPress", "KeyDiffPress"),
    "criticalkv": ("CriticalKVPress", "SnapKVPress"),
    "critical_adakv": ("CriticalAdaKVPress", "SnapKVPress"),
    "entropy_chunkkv": ("EntropyGatedChunkKVPress", "SnapKVPress"),
    "key_rerotation": ("KeyRerotationPress", "KnormPress"),
    "merging": ("MergingPress", "KnormPress"),
}
# kvpress presses changed to test a difference from jaxkv's policy of the same name:
#   kvzip_scored_prefix  KVzipPress scoring the whole context. kvpress skips the chat template's
#                        prefix (SmolLM2's system turn and user header, 24 tokens): past the 4
#                        sinks it keeps score 0, so the global threshold evicts it first, and
#                        the replay's softmax leaves it out. jaxkv's KVzip scores every token.
# (`ruler_report.KVPRESS_VARIANTS`: the jaxkv policy entry each is set against.)
VARIANTS = tuple(KVPRESS_VARIANTS)
# The attention each press runs under: eager (which every press but KVzip supports, and
# ObservedAttention needs for its attention weights) unless named here.
# KVzipPress refuses eager, and the wrappers refuse attention weights.
ATTENTION = {"kvzip": "sdpa", "kvzip_scored_prefix": "sdpa"} | dict.fromkeys(WRAPPERS, "sdpa")
# The presses --reuse runs by default: the full cache and those of jaxkv's policies.
REUSE_PRESSES = ("full", "kvzip", "kvzip_scored_prefix", "snapkv", "tova", "streaming_llm", "knorm")
# Options of one mode only: (option, its mode).
_QUALITY_ONLY = ("tasks", "settings", "samples", "replace")
_REUSE_ONLY = ("questions",)
# Presses that score with the question (FinchPress): --ruler's aware setting only.
QUESTION_PRESSES = ("finch",)


def load_model(path: Path):
    """(model, the ids it stops at) from the GGUF file, f32, eager attention (`ATTENTION`); the
    stop ids are the generation config's eos ids and the chat's end of turn, as `real_quality`
    stops."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype="float32", attn_implementation="eager"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # KVzipPress reads the tokenizer from `config.name_or_path`: a directory it can open.
    model.config.name_or_path = saved_tokenizer_directory(tokenizer)
    model.eval()
    eos = model.generation_config.eos_token_id
    stop = {
        *(eos if isinstance(eos, list) else [eos]),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }
    return model, stop


def saved_tokenizer_directory(tokenizer) -> str:
    """A directory from which `AutoTokenizer.from_pretrained` loads `tokenizer` as it is.

    transformers' GGUF tokenizer saves as "CodeLlamaTokenizer", and that class rebuilds a
    sentencepiece-style pre-tokenizer on loading: SmolLM2's byte-level BPE then encodes every
    space as id 0, so KVzipPress's repeat prompt would come out garbled. Saved as the fast
    tokenizer its tokenizer.json describes, it loads unchanged (checked here on a sentence).
    """
    import transformers

    directory = tempfile.mkdtemp(prefix="jaxkv-kvpress-tokenizer-")
    tokenizer.save_pretrained(directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    probe = "\n\nRepeat the previous context exactly."
    reloaded = transformers.AutoTokenizer.from_pretrained(directory)
    saved, original = (t.encode(probe, add_special_tokens=False) for t in (reloaded, tokenizer))
    if saved != original:
        raise RuntimeError(f"the saved tokenizer encodes {probe!r} as {saved}, not {original}")
    return directory


def make_press(name: str, budget: float | None, question_tokens: int | None = None):
    """kvpress's press for jaxkv policy `name` keeping `budget` of the prompt; None: none.
    FINCH's takes `question_tokens`, the prompt's last tokens it scores with: its
    `window_size`, which its embedding hook would set from a delimiter token kvpress adds to
    the tokenizer; the token ids here carry none, so the hook is given an id no token has."""
    if name == "full":
        return None
    import kvpress

    if name == "finch":
        if question_tokens is None:
            raise ValueError("finch: give question_tokens (its window: the question's tokens)")
        press = kvpress.FinchPress(compression_ratio=1.0 - budget)
        press.delimiter_token_id, press.window_size = -1, question_tokens
        return press

    if name == "kvzip_scored_prefix":
        return _kvzip_scoring_prefix(kvpress.KVzipPress)(compression_ratio=1.0 - budget)
    if name in WRAPPERS:
        wrapper, inner = WRAPPERS[name]
        return getattr(kvpress, wrapper)(getattr(kvpress, inner)(compression_ratio=1.0 - budget))
    return getattr(kvpress, PRESSES[name])(compression_ratio=1.0 - budget)


def _kvzip_scoring_prefix(press_class):
    """KVzipPress replaying and scoring the context from its first token (`VARIANTS`)."""

    class KVzipScoringPrefix(press_class):
        def prepare(self, model, tokenizer, *args, **kwargs):
            # kvpress reads the prefix length from the chat template before the replay and
            # starts both the replayed chunks and the scored slots there.
            self.prefix_length = 0
            return super().prepare(model, tokenizer, *args, **kwargs)

    return KVzipScoringPrefix


def rerotates(press) -> bool:
    """Whether kvpress's pipeline reads on after `press` from the kept count (its condition)."""
    import kvpress

    return isinstance(press, kvpress.KeyRerotationPress) or (
        isinstance(press, kvpress.FinchPress) and press.rerotate_keys
    )


def answer(model, press, prefill_ids: list[int], question_ids: list[int], steps: int, stop):
    """kvpress's pipeline for one episode: prefill under the press, then greedy decoding of
    `steps` tokens (the question read first when it was not prefilled), from the prefill's
    length or, after a press that rerotates its kept keys to 0..n-1, from n, as the pipeline
    reads on from `cache.get_seq_length()`. Returns (token ids [steps], the bytes of keys and
    values the cache held after the prefill).

    A cache whose layers hold different numbers of tokens (PyramidKV's) reads the question one
    token at a time: transformers builds one causal mask from layer 0's length, so a question
    read at once would see its own later tokens in every shorter layer (4.56: the mask cut to
    the layer's keys) or stop (5.2: a size mismatch). One token needs no causal structure."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    context = torch.tensor([prefill_ids])
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=context, past_key_values=cache, num_logits_to_keep=1)
        held = sum(
            (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
            for layer in cache.layers
        )
        position = cache.get_seq_length() if rerotates(press) else len(prefill_ids)
        uneven = len({layer.keys.shape[-2] for layer in cache.layers}) > 1
        if not question_ids:
            reads = []
        elif uneven:
            reads = [[token] for token in question_ids]
        else:
            reads = [question_ids]
        for ids in reads:
            out = model(
                input_ids=torch.tensor([ids]),
                past_key_values=cache,
                position_ids=torch.arange(position, position + len(ids))[None],
                num_logits_to_keep=1,
            )
            position += len(ids)
        generated = [int(out.logits[0, -1].argmax())]
        while len(generated) < steps and generated[-1] not in stop:
            out = model(
                input_ids=torch.tensor([[generated[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[position]]),
            )
            position += 1
            generated.append(int(out.logits[0, -1].argmax()))
    return np.asarray(generated + [0] * (steps - len(generated))), held


def run_cell(model, stop, tokenizer, press, episodes, setting: str) -> dict:
    """Scores of one (press, setting) over the episodes, as `real_quality.run_cell` reports."""
    results, held = [], []
    for episode in episodes:
        if setting == "aware":
            prefill, question = list(episode.context_ids + episode.question_ids), []
        else:
            prefill, question = list(episode.context_ids), list(episode.question_ids)
        tokens, kv_bytes = answer(model, press, prefill, question, ANSWER_TOKENS, stop)
        results.append(score(tokenizer, tokens, episode.answer))
        held.append(kv_bytes)
    exact = sum(r[0] for r in results)
    return {
        "exact": exact / len(episodes),
        "exact_interval": harness.wilson_interval(exact, len(episodes)),
        "leading_digits": float(np.mean([r[1] for r in results])),
        "samples": len(episodes),
        "kv_bytes_per_sequence": float(np.mean(held)),
    }


def document_pipeline(model):
    """kvpress's `KVPressTextGenerationPipeline` over `model`, reading the document's token ids
    as they are: its `preprocess` (chat template, tokenizing) is the one step replaced (see the
    module's docstring); the prefill under the press, the greedy answer to each question and the
    cache cut back to the context after each are kvpress's own."""
    import torch
    import transformers
    from kvpress import KVPressTextGenerationPipeline

    class DocumentPipeline(KVPressTextGenerationPipeline):
        def preprocess(self, context, questions, *args, **kwargs):
            return {
                "context_ids": torch.tensor([list(context)]),
                "questions_ids": [torch.tensor([list(q)]) for q in questions],
            }

    tokenizer = transformers.AutoTokenizer.from_pretrained(model.config.name_or_path)
    return DocumentPipeline(model=model, tokenizer=tokenizer)


def kept_share(model, cache, context_length: int) -> float:
    """The share of the context's keys and values that answers can attend to: what the cache
    holds, less what a masking press (KVzip: `masked_key_indices`) hides."""
    held = masked = 0
    for layer, cached in zip(model.model.layers, cache.layers, strict=True):
        held += cached.keys.shape[1] * cached.keys.shape[2]
        indices = getattr(layer.self_attn, "masked_key_indices", None)
        masked += 0 if indices is None else len(indices[0])
    heads = cache.layers[0].keys.shape[1]
    return (held - masked) / (len(cache.layers) * heads * context_length)


def ask_document(pipe, tokenizer, name: str, budget: float | None, document: Document) -> dict:
    """One press's row: `pipe(context, questions=[...])` once over the document, each answer's
    text and its exact match (`needles.score`'s rule on the text, re-encoded)."""
    from transformers import DynamicCache

    pipe.model.set_attn_implementation(ATTENTION.get(name, "eager"))
    for layer in pipe.model.model.layers:  # a previous press's mask: eager neither reads nor
        layer.self_attn.masked_key_indices = None  # clears it (kvpress patches sdpa's only)
    cache = DynamicCache()
    start = time.perf_counter()
    answers = pipe(
        document.context_ids,
        questions=list(document.questions),
        press=make_press(name, budget),
        max_new_tokens=ANSWER_TOKENS,
        cache=cache,
    )["answers"]
    seconds = time.perf_counter() - start
    exact = [
        score(tokenizer, tokenizer.encode(text, add_bos=False), number)[0]
        for text, number in zip(answers, document.answers, strict=True)
    ]
    return {
        "press": name,
        "kvpress_press": None if name == "full" else PRESSES.get(name, WRAPPERS.get(name, name)),
        "budget": budget,
        "compression_ratio": None if budget is None else 1.0 - budget,
        "attention": ATTENTION.get(name, "eager"),
        "kept_share": kept_share(pipe.model, cache, len(document.context_ids)),
        "answers": answers,
        "exact": exact,
        "exact_count": sum(exact),
        "seconds": seconds,
    }


def reuse_markdown(report: dict) -> str:
    """The --reuse report as a table: each press's exact matches and answers."""
    lines = [
        f"# kvpress's pipeline, one compressed context, {report['questions']} questions "
        f"({report['model']})",
        "",
        f"`{report['provenance']['command']}` at {report['provenance']['commit']}, "
        f"{report['provenance']['date']}, kvpress {report['provenance']['kvpress']}, "
        f"transformers {report['provenance']['transformers']}, "
        f"torch {report['provenance']['torch']}.",
        "",
        "| press | compression ratio | kept | exact | answers |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        ratio = "-" if row["compression_ratio"] is None else f"{row['compression_ratio']:.2f}"
        answers = " / ".join(a.strip().replace("|", "\\|") for a in row["answers"])
        lines.append(
            f"| {row['press']} | {ratio} | {row['kept_share']:.3f} "
            f"| {row['exact_count']}/{report['questions']} | {answers} |"
        )
    return "\n".join(lines) + "\n"


def run_reuse(args: argparse.Namespace, argv: list[str]) -> dict:
    """--reuse: each press once over `jaxkv bench reuse`'s document; writes the report."""
    path = downloads.model_path(args.model)
    (model, _), tokenizer = load_model(path), gguf_tokenizer(path)
    document = build_document(tokenizer, args.lengths[0], args.questions)
    pipe = document_pipeline(model)
    rows = []
    for name in args.presses:
        for budget in [None] if name == "full" else args.budgets:
            rows.append(ask_document(pipe, tokenizer, name, budget, document))
            print(json.dumps(rows[-1]), flush=True)
    report = {
        "provenance": reference_provenance(argv),
        "model": args.model,
        "file_sha256": downloads.KNOWN_MODELS[args.model].sha256,
        "context_tokens": len(document.context_ids),
        "questions": args.questions,
        "question_tokens": [len(q) for q in document.questions],
        "needles": list(document.answers),
        "answer_tokens": ANSWER_TOKENS,
        "rows": rows,
    }
    markdown = reuse_markdown(report)
    harness.save(args.out / Path(args.model).stem, "reuse-kvpress", report, markdown)
    print(markdown)
    return report


def reference_provenance(argv: list[str]) -> dict:
    """`harness.provenance` of this command, with kvpress's, torch's and transformers'
    versions."""
    import kvpress
    import torch
    import transformers

    provenance = harness.provenance("python -m jaxkv.benchmarks.kvpress_reference", argv)
    return provenance | {
        "kvpress": getattr(kvpress, "__version__", "0.5.5"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def ruler_samples(path: Path, count: int, tasks) -> list:
    """The samples of `jaxkv bench ruler`'s export `path` with index below `count`, of `tasks`
    (all when empty); SystemExit when the file holds samples of more than one (length,
    seed): which to compare would be a guess."""
    records = read_jsonl(path)
    runs = sorted({(r.get("length"), r.get("seed")) for r in records}, key=str)
    if len(runs) > 1:
        raise SystemExit(f"--ruler {path}: samples of several (length, seed) runs {runs}")
    samples = [sample_from_json(r) for r in records]
    return [s for s in samples if s.index < count and (s.task in tasks or not tasks)]


def run_ruler(args: argparse.Namespace, argv: list[str]) -> dict:
    """--ruler: every exported sample through kvpress's presses; records appended as they end,
    OUT/run.json the provenance of the latest (resumed) run and every distinct command run."""
    samples = ruler_samples(args.ruler, args.samples, args.tasks)
    path = downloads.model_path(args.model)
    (model, stop), tokenizer = load_model(path), gguf_tokenizer(path)
    args.out.mkdir(parents=True, exist_ok=True)
    provenance = reference_provenance(argv)
    commands = harness.commands_so_far(args.out / "run.json", provenance["command"])
    run = {"provenance": provenance, "commands": commands, "model": args.model}
    (args.out / "run.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    records = args.out / "records.jsonl"
    done = {record_key(r) for r in load_records(records)}
    presses = {name: name for name in args.presses}
    cells = ruler_tasks.cells(presses, args.ratios, args.settings, ruler_tasks.AWARE_POLICIES)
    jobs = [
        (name, ratio, setting, sample)
        for name, ratio, setting in cells
        for sample in sorted(samples, key=lambda s: (s.index, s.task))
        if (sample.task, sample.index, name, ratio, setting) not in done
    ]
    for name, ratio, setting, sample in tqdm(jobs, desc="kvpress ruler", unit="sample"):
        model.set_attn_implementation(ATTENTION.get(name, "eager"))
        press = make_press(
            name, None if name == "full" else 1.0 - ratio, sample.question_turn_tokens
        )
        context, question = sample.split(setting)
        start = time.perf_counter()
        tokens, held = answer(model, press, context, question, sample.max_new_tokens, stop)
        predicted = prediction(tokenizer, tokens.tolist(), stop)
        record = {"task": sample.task, "index": sample.index, "policy": name, "ratio": ratio}
        record |= {
            "setting": setting,
            "prediction": predicted,
            "score": string_match_all(predicted, sample.outputs),
            "outputs": list(sample.outputs),
            "kv_bytes": float(held),
            "context_tokens": len(sample.context_ids),
            "prompt_tokens": len(sample.context_ids) + len(sample.question_ids),
            "compressed_tokens": len(context),
            "seconds": round(time.perf_counter() - start, 2),
            "transformers": provenance["transformers"],  # the lanes may run two versions
        }
        append_record(records, record)
    return {"records": len(load_records(records))}


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The command line, checked, with each mode's defaults filled in (--reuse: `jaxkv bench
    reuse`'s document; otherwise `real_quality`'s episodes)."""
    parser = argparse.ArgumentParser(prog="jaxkv bench kvpress_reference")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a fetched model")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="`jaxkv bench reuse`'s document: every question through kvpress's pipeline over "
        "one compressed context",
    )
    parser.add_argument("--presses", nargs="+", help=f"--reuse: {' '.join(REUSE_PRESSES)}")
    parser.add_argument(
        "--ruler",
        type=Path,
        metavar="SAMPLES.jsonl",
        help="`jaxkv bench ruler`'s exported samples: each through kvpress's presses",
    )
    parser.add_argument(
        "--ratios", type=float, nargs="+", help="--ruler: compression ratios (share evicted)"
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.3])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--tasks", nargs="+")
    parser.add_argument("--settings", nargs="+")
    parser.add_argument("--samples", type=int)
    parser.add_argument("--questions", type=int, help="--reuse: the document's needles, each asked")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--replace",
        action="store_true",
        help="run the cells again where the report has them, replacing their rows",
    )
    args = parser.parse_args(argv)
    other_mode = _REUSE_ONLY if not args.reuse else _QUALITY_ONLY
    for option in other_mode:
        if getattr(args, option) not in (None, False):
            mode = "with --reuse only" if option in _REUSE_ONLY else "real_quality's, not --reuse's"
            raise SystemExit(f"--{option}: an option {mode}")
    for name in args.presses or []:
        if name != "full" and name not in {*PRESSES, *WRAPPERS, *VARIANTS, *QUESTION_PRESSES}:
            known = sorted([*PRESSES, *WRAPPERS, *VARIANTS, *QUESTION_PRESSES])
            raise SystemExit(f"--presses {name}: kvpress presses here are full, {known}")
        if name in QUESTION_PRESSES and args.ruler is None:
            raise SystemExit(f"--presses {name}: --ruler only (its window is a sample's question)")
        if name in QUESTION_PRESSES and "agnostic" in (args.settings or ["agnostic"]):
            raise SystemExit(
                f"--presses {name}: scores with the question, which the agnostic setting reads "
                "after compressing: give --settings aware"
            )
    for budget in args.budgets:
        if not 0 < budget < 1:
            raise SystemExit(f"--budgets {budget}: a share of the prompt kept, in (0, 1)")
    if args.ruler is not None:
        defaults = {
            "presses": ["full", *PRESSES],
            "ratios": list(ruler_tasks.RATIOS),
            "tasks": [],
            "settings": list(ruler_tasks.SETTINGS),
            "samples": 1_000_000,
            "out": args.ruler.parent / "kvpress",
        }
        for option, value in defaults.items():
            if getattr(args, option) is None:
                setattr(args, option, value)
        _check_ruler_options(args)
        return args
    if args.ratios is not None:
        raise SystemExit("--ratios: an option of --ruler")
    if args.reuse:
        if len(args.lengths) != 1:
            raise SystemExit("--lengths: --reuse compresses one context, of one length")
        if args.questions is not None and args.questions < 1:
            raise SystemExit(f"--questions {args.questions}: at least one")
        defaults = {
            "presses": list(REUSE_PRESSES),
            "questions": 8,
            "out": Path("results/reuse/kvpress"),
        }
    else:
        defaults = {
            "presses": ["full", "snapkv", "streaming_llm"],
            "tasks": list(TASKS),
            "settings": list(SETTINGS),
            "samples": 16,
            "out": Path("results/real-quality/needles-2k/kvpress"),
        }
    for option, value in defaults.items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    return args


def _check_ruler_options(args: argparse.Namespace) -> None:
    """SystemExit for a --ruler run's ratio, task or setting that RULER's runner has not."""
    harness.check_ratios(args.ratios)
    for option, given, allowed in (
        ("tasks", args.tasks, ruler_tasks.TASKS),
        ("settings", args.settings, ruler_tasks.SETTINGS),
    ):
        for value in given:
            if value not in allowed:
                raise SystemExit(f"--{option} {value}: --ruler's are {', '.join(allowed)}")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_arguments(argv)
    if args.ruler is not None:
        return run_ruler(args, argv)
    if args.reuse:
        return run_reuse(args, argv)
    path = downloads.model_path(args.model)
    (model, stop), tokenizer = load_model(path), gguf_tokenizer(path)
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "quality.json"
    previous = json.loads(report_path.read_text()) if report_path.exists() else {}
    rows = previous.get("rows", [])
    done = {cell_key(r) for r in rows}
    cells = [
        (name, None if name == "full" else budget, length, task, setting)
        for name in args.presses
        for budget in ([None] if name == "full" else args.budgets)
        for length in args.lengths
        for task in args.tasks
        for setting in args.settings
    ]
    if not args.replace:
        cells = [cell for cell in cells if cell not in done]
    import kvpress
    import transformers

    provenance = reference_provenance(argv)
    commands = harness.commands_so_far(report_path, "kvpress_reference " + " ".join(argv))
    for name, budget, length, task, setting in tqdm(cells, desc="kvpress", unit="cell"):
        episodes = [build_episode(tokenizer, task, length, i) for i in range(args.samples)]
        model.set_attn_implementation(ATTENTION.get(name, "eager"))
        result = run_cell(model, stop, tokenizer, make_press(name, budget), episodes, setting)
        row = {"policy": name, "budget": budget, "length": length, "task": task}
        row = {**row, "setting": setting, **result}
        rows = [r for r in rows if cell_key(r) != cell_key(row)] + [row]
        print(json.dumps(rows[-1]), flush=True)
        report = {
            "provenance": provenance,
            "commands": commands,
            "model": args.model,
            "file_sha256": downloads.KNOWN_MODELS[args.model].sha256,
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
            "transformers": transformers.__version__,
            "rows": rows,
        }
        harness.save(args.out, "quality", report)  # after each row: a cut run resumes
    table = markdown_table(rows)
    (args.out / "quality.md").write_text(table)
    print(table)
    return {"rows": rows}


if __name__ == "__main__":
    main()
