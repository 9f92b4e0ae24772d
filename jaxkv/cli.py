"""The `jaxkv` command line: `jaxkv generate`, `jaxkv train STAGE`, `jaxkv bench NAME`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The bundled reference model (docs/reference-model.md), trained by `jaxkv train pretrain`.
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "assets" / "reference-model")
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


def _load(model_arg: str, dtype: str, seed: int):
    """A checkpoint directory, or the name of a built-in preset (random weights)."""
    from models import byte_tokenizer, init_model, load_hf_checkpoint, load_tokenizer, preset
    from models.configs import PRESETS, dtype_from_name

    path = Path(model_arg)
    if path.is_dir():
        model = load_hf_checkpoint(path, dtype=dtype)
        has_tokenizer = (path / "tokenizer.json").exists()
        return model, load_tokenizer(path) if has_tokenizer else byte_tokenizer()
    if model_arg in PRESETS:
        model = init_model(preset(model_arg), seed=seed, dtype=dtype_from_name(dtype or "float32"))
        return model, byte_tokenizer()
    raise SystemExit(
        f"--model {model_arg!r}: neither a checkpoint directory nor a preset "
        f"({', '.join(sorted(PRESETS))})"
    )


def _budget_kwargs(budget: str | None) -> dict:
    """--budget 0.3 is a ratio of the prompt, --budget 256 a token count."""
    if budget is None:
        return {}
    return {"budget": float(budget) if "." in budget else int(budget)}


def _generate(args) -> int:
    import jax

    import jaxkv
    from jaxkv import policies

    model, tokenizer = _load(args.model, args.dtype, args.seed)
    policy = policies.get(args.policy, **_budget_kwargs(args.budget))
    sampler = jaxkv.Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompt_ids = tokenizer.encode(args.prompt)
    stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    out = jaxkv.generate(
        model,
        [prompt_ids],
        max_new_tokens=args.max_new_tokens,
        policy=policy,
        sampler=sampler,
        key=jax.random.PRNGKey(args.seed),
        stop_tokens=stop,
        pad_id=tokenizer.pad_id,
        page_size=args.page_size,
        backend=args.backend,
    )
    n = int(out.num_tokens[0])
    report = {
        "model": args.model,
        "policy": args.policy,
        "budget": args.budget,
        "backend": args.backend,
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": n,
        "pages_in_use_after_prefill": int(out.pages_in_use[0]),
        "pages_in_use_final": int(out.pages_in_use[-1]),
        "kv_bytes_final": int(out.memory_bytes[-1]),
    }
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tokenizer.decode(out.tokens[0, :n])!r}")
    print(json.dumps(report, indent=2))
    return 0


TRAIN_STAGES = ("pretrain", "wgkv", "fastkvzip")
BENCHMARKS = ("quality", "kernels", "decode")


def _train(args) -> int:
    if args.stage == "pretrain":
        from train import pretrain

        pretrain.main(args.args)
    elif args.stage == "wgkv":
        from train import wgkv

        wgkv.main(args.args)
    elif args.stage == "fastkvzip":
        from train import fastkvzip

        fastkvzip.main(args.args)
    return 0


def _bench(args) -> int:
    import importlib

    importlib.import_module(f"benchmarks.{args.name}").main(args.args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text through the paged KV cache")
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory (Hugging Face format) or preset name",
    )
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--policy", default="full", help="cache policy name")
    gen.add_argument(
        "--budget", default=None, help="KV budget per head: a ratio (0.3) or a token count (256)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    gen.add_argument(
        "--backend",
        default="xla",
        choices=("xla", "pallas", "interpret"),
        help="attention: jnp (xla), the Pallas kernels on a GPU (pallas), or interpreted",
    )
    gen.set_defaults(run=_generate)
    train = commands.add_parser("train", help="train a model or gates (`jaxkv train STAGE -h`)")
    train.add_argument("stage", choices=TRAIN_STAGES)
    train.add_argument("args", nargs=argparse.REMAINDER, help="the stage's own arguments")
    train.set_defaults(run=_train)
    bench = commands.add_parser("bench", help="run a benchmark (`jaxkv bench NAME -h`)")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, KeyError) as error:
        print(f"jaxkv {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
