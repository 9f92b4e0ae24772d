"""What the calibration stages share (`jaxkv train duo_attention | qfilter |
expected_attention_stats`): nothing is trained; contexts of the corpus's train split in the
model's ids run through the model, and a summary of what it does on them is written with the
command that made it."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxkv import bundled
from jaxkv.train import corpus as corpus_lib
from jaxkv.train.fastkvzip import TRAIN_SEED, contexts


def calibration_parser(
    stage: str, description: str, writes: str, *, contexts: int, length: int
) -> argparse.ArgumentParser:
    """`jaxkv train STAGE`'s parser with the options every calibration stage takes: --model,
    --out (a directory for `writes`), --contexts, --length, --context-batch and --text."""
    parser = argparse.ArgumentParser(prog=f"jaxkv train {stage}", description=description)
    parser.add_argument(
        "--model",
        default=str(bundled.REFERENCE_MODEL),
        help="a checkpoint directory, a .gguf file or a fetched model's name (jaxkv fetch)",
    )
    parser.add_argument("--out", type=Path, required=True, help=f"directory for {writes}")
    parser.add_argument("--contexts", type=int, default=contexts, help="calibration contexts")
    parser.add_argument("--length", type=int, default=length, help="tokens per context")
    parser.add_argument("--context-batch", type=int, default=2, help="contexts a pass")
    corpus_lib.add_text_argument(parser)
    return parser


def check_counts(args: argparse.Namespace, *options: str) -> None:
    """ValueError naming the first of `options` ("--contexts", ...) given a value below 1."""
    for option in options:
        value = getattr(args, option.removeprefix("--").replace("-", "_"))
        if value < 1:
            raise ValueError(f"{option} {value} must be >= 1")


def calibration_rows(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """The stage's contexts (`fastkvzip.contexts` of the train split, its seed)."""
    return contexts("train", args.contexts, args.length, TRAIN_SEED, tokenizer, text=args.text)
