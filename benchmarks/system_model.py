"""The model and policy a system-benchmark row measures, and what a request on it needs: the
built-in shapes (`--model`), the ModelConfig of the arguments, a policy spec with fresh
parameters, and the weight and full-cache memory estimates a row is checked against before it
runs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax

from jaxkv import policies
from jaxkv.models import configs
from jaxkv.models.decoder import param_shapes

GIB = 2**30
MIB = 2**20
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# Random weights with Llama-3.1-8B layer shapes; vocabulary and depth can be cut by flags.
LLAMA3_8B_SHAPE = {
    "family": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
CPU_SHAPE = {
    "family": "llama",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
# KV-heavy: 8 KV heads x 128 per layer (no GQA), a small MLP and vocabulary, so a decode step
# reads far more KV than weights at 4K+ tokens (issue 27's shape).
CPU_KV_SHAPE = {
    "family": "llama",
    "vocab_size": 512,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 16384,
}
SHAPES = {"llama3-8b-shape": LLAMA3_8B_SHAPE, "cpu-mid": CPU_SHAPE, "cpu-kv": CPU_KV_SHAPE}


def model_config(args):
    """The ModelConfig of `--model` (a built-in shape, a models preset, or an HF config.json)
    with `--layers` / `--vocab-size` applied and positions raised to the longest request."""
    if args.model in SHAPES:
        shape = dict(SHAPES[args.model])
        cfg = configs.ModelConfig(**{**shape, "family": configs.Family(shape["family"])})
    elif args.model in configs.PRESETS:
        cfg = configs.preset(args.model)
    else:
        path = Path(args.model)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise SystemExit(
                f"--model {args.model!r}: not a built-in shape {sorted(SHAPES)}, a preset "
                f"{sorted(configs.PRESETS)}, nor an existing config.json"
            )
        cfg = configs.from_hf_config(json.loads(path.read_text()))
    overrides = {"num_layers": args.layers, "vocab_size": args.vocab_size}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    longest = max(args.contexts) + args.decode_start + args.decode_tokens + 1
    if cfg.max_position_embeddings < longest:  # random weights: any position is as good
        cfg = dataclasses.replace(cfg, max_position_embeddings=longest)
    return cfg


def weight_bytes(cfg, itemsize: int) -> dict:
    """Parameter bytes and the bytes one decode step reads (an untied embedding: B rows only)."""
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for s in _leaves(shapes)) * itemsize
    embed = math.prod(shapes["embed"]) * itemsize
    read = total if cfg.tie_word_embeddings else total - embed
    return {"total": total, "read_per_step": read}


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


def memory_estimate(cfg, itemsize: int, context: int, batch: int, args) -> dict:
    """Bytes a full-cache `generate` needs (an upper bound for every policy): weights, the prefill
    pool and the repacked decode pool (alive together), and the largest attention temporaries
    (XLA backend: a chunk's f32 scores and probabilities over the whole context, and the
    gathered f32 keys/values of one layer)."""
    page = args.page_size
    tokens = -(-(context + args.decode_start + args.decode_tokens) // page) * page
    per_token_head = 2 * cfg.head_dim * itemsize + 8  # K, V + position and score metadata
    kv = cfg.num_layers * batch * cfg.num_kv_heads * tokens * per_token_head
    chunk = min(args.prefill_chunk, context)
    temporaries = 2 * batch * cfg.num_kv_heads * tokens * cfg.head_dim * 4
    if args.backend == "xla":
        temporaries += 2 * batch * cfg.num_heads * chunk * tokens * 4
    hidden = batch * chunk * (cfg.intermediate_size * 3 + cfg.vocab_size) * 4
    weights = weight_bytes(cfg, itemsize)["total"]
    total = weights + 2 * kv + temporaries + hidden
    return {"weights": weights, "kv_full": kv, "temporaries": temporaries + hidden, "total": total}


def largest_fitting(cfg, itemsize: int, limit: int, context: int, batch: int, args) -> dict:
    """The largest context at this batch and the largest batch at this context that fit."""

    def fits(c, b):
        return memory_estimate(cfg, itemsize, c, b, args)["total"] <= limit

    def search(test, high):
        low = 0
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if test(mid) else (low, mid - 1)
        return low

    step = args.page_size
    best_context = step * search(lambda n: fits(n * step, batch), max(context // step, 1))
    best_batch = search(lambda b: fits(context, b), batch)
    return {"largest_context": best_context, "largest_batch": best_batch}


def does_not_fit_message(cfg, itemsize, limit, context, batch, args, reason: str) -> str:
    est = memory_estimate(cfg, itemsize, context, batch, args)
    best = largest_fitting(cfg, itemsize, limit, context, batch, args)
    return (
        f"does not fit ({reason}): context {context} x batch {batch} needs ~"
        f"{est['total'] / GIB:.2f} GiB (weights {est['weights'] / GIB:.2f} + 2 x full KV "
        f"{est['kv_full'] / GIB:.2f} + temporaries {est['temporaries'] / GIB:.2f}) of "
        f"{limit / GIB:.2f} GiB; largest context that fits at batch {batch}: "
        f"~{best['largest_context']} tokens; largest batch at context {context}: "
        f"{best['largest_batch']}"
    )


def parse_policy(spec: str):
    """The policy of `spec` (`policies.from_spec`): a named SystemExit for a bad spec, before
    anything is measured."""
    try:
        return policies.from_spec(spec)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def build_policy(spec: str, cfg, seed: int = 0):
    """(policy, policy_params) for a spec: the policy's own fresh (untrained) parameters
    (`policy.params.init`; duo_attention's first `retrieval_share` of every layer's heads)."""
    policy = parse_policy(spec)
    part = policy.params
    return policy, None if part is None else part.init(cfg, jax.random.PRNGKey(seed))
