"""What the model commands share (`jaxkv generate`, `ask`, `serve`): their options, the policy
and cache they build from them (checked before the model loads), its parameters, and the report's
timings and prefill progress."""

from __future__ import annotations

import argparse
import logging
import sys
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


def no_params_error(policy, model_arg: str) -> ValueError:
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
    raise no_params_error(policy, args.model)


def check_runs_here(backend: str) -> None:
    """--backend pallas on a machine without a GPU: the error now, before loading the model."""
    from jaxkv.attention import check_runs_here as check

    check(backend)


def add_model_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
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
        "gates of the reference model), duo_attention (a bool [L, K] .npy; without it the "
        "retrieval heads are picked on the prompt, --policy-arg retrieval_share=0.25) or "
        "qfilter / expected_attention_stats (filters.npy / statistics.npz; default: the shipped "
        "ones) or kvzap (linear.npz / mlp.npz, `jaxkv train kvzap`)",
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


def read_text(path: str, option: str) -> str:
    """The text of a file option (a path, or - for standard input)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    if not text.strip():
        raise ValueError(f"{option} {path}: the text is empty")
    return text
