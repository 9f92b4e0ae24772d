"""`jaxkv generate`: text through the paged KV cache, with a report of what the cache held."""

from __future__ import annotations

import json

from jaxkv.cli.options import (
    DEFAULT_PROMPT,
    PrefillProgress,
    add_model_options,
    cache_config,
    policy_before_loading,
    policy_budget,
    policy_params,
    read_text,
    timings,
)


def add_parser(commands) -> None:
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
    add_model_options(gen, max_new_tokens=32)
    gen.set_defaults(run=run)


def run(args) -> int:
    import jax

    import jaxkv
    from jaxkv.model_sources import load_model, stop_tokens
    from jaxkv.models import encode_chat

    policy = policy_before_loading(args)
    if args.prompt_file is not None:
        args.prompt = read_text(args.prompt_file, "--prompt-file")
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
