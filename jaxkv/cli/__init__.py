"""The `jaxkv` command line: `jaxkv generate`, `jaxkv ask`, `jaxkv serve`, `jaxkv fetch NAME`,
`jaxkv train STAGE`, `jaxkv bench NAME`; a module per command (`add_parser`, `run`), the options
they share in `options`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from jaxkv.cli import ask, generate, registered, serve
from jaxkv.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_PROMPT,
    LOG,
    PrefillProgress,
    policy_budget,
    policy_kwargs,
)
from jaxkv.cli.registered import BENCH_GROUP, TRAIN_GROUP, registered_commands

__all__ = [
    "BENCH_GROUP",
    "DEFAULT_MODEL",
    "DEFAULT_PROMPT",
    "TRAIN_GROUP",
    "PrefillProgress",
    "build_parser",
    "main",
    "policy_budget",
    "policy_kwargs",
    "registered_commands",
]


DESCRIPTION = (
    "Long-context inference with a compressed KV cache: `jaxkv generate`, `jaxkv ask`, "
    "`jaxkv serve`, `jaxkv fetch NAME`, `jaxkv train STAGE`, `jaxkv bench NAME`."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(commands)
    ask.add_parser(commands)
    serve.add_parser(commands)
    registered.add_parsers(commands)
    return parser


# Commands that log their progress to stderr even when it is a file: long runs that a user
# redirects (`jaxkv ask ... 2> log`) and then waits on.
LOGGING_COMMANDS = ("generate", "ask", "train")


class _StderrHandler(logging.Handler):
    """Writes records to whatever `sys.stderr` is when they come."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


@contextlib.contextmanager
def _progress_on_stderr(to_logs: bool):
    """Within the block, the `jaxkv` logger's INFO messages (compiling ..., `jaxkv.compile_log`;
    prefill progress; a training run's resumption and checkpoints) go to stderr when stderr is
    a terminal (a user waiting on a first call) or `to_logs` (commands whose stderr is often a
    log file); other piped output stays as it was. The logger is as it was after the block."""
    if not (sys.stderr.isatty() or to_logs):
        yield
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("jaxkv: %(message)s"))
    propagate, level = LOG.propagate, LOG.level
    LOG.addHandler(handler)
    LOG.propagate = False  # the root logger (absl's, where set) would print it twice
    LOG.setLevel(logging.INFO)
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        LOG.propagate = propagate
        LOG.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _progress_on_stderr(to_logs=args.command in LOGGING_COMMANDS):
            return args.run(args)
    except (ValueError, KeyError, OSError) as error:
        # A KeyError's str() is its repr; the message itself reads better.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"jaxkv {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
