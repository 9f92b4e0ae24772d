"""`jaxkv serve`: the OpenAI-compatible HTTP server over the engine (the serve extra)."""

from __future__ import annotations

from jaxkv.cli.options import add_model_options, cache_config, policy_before_loading, policy_params


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the continuous-batching engine (serve extra)",
        description="An OpenAI-compatible HTTP server over the continuous-batching engine. "
        "--max-new-tokens, --temperature, --top-k and --top-p are the defaults of a request that "
        "leaves max_tokens, temperature, top_k or top_p out.",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (/v1/models, a request's model field; default: the "
        "short name of --model, e.g. smollm2-135m-instruct)",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--num-pages", type=int, default=4096, help="the engine's page pool")
    serve.add_argument(
        "--int8-pages",
        type=int,
        default=None,
        help="with --storage int8, the int8 tier's page pool (default: --num-pages)",
    )
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
        "--max-contexts",
        type=int,
        default=8,
        help="cached contexts held at once: documents compressed once that many requests read "
        "(POST /v1/contexts, and chats' messages before the last user turn); idle ones are "
        "dropped, least recently used, when requests need their pages (0: none)",
    )
    serve.add_argument(
        "--auto-context-tokens",
        type=int,
        default=256,
        help="a chat's messages before its last user turn become a cached context when they "
        "hold at least this many tokens",
    )
    serve.add_argument(
        "--contexts-dir",
        default=None,
        help="a folder the cached contexts are saved to when the server stops and loaded from "
        "when it starts (default: none; contexts live as long as the process)",
    )
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
        help="serve at once, without compiling the engine's step programs first "
        "(Engine.warm_up): a request then waits for the programs its step needs to compile",
    )
    add_model_options(serve, max_new_tokens=16)
    serve.set_defaults(run=run)


def run(args) -> int:
    import jaxkv
    from jaxkv.model_sources import load_model, short_name
    from jaxkv.sharding import mesh_from_text

    try:
        import uvicorn

        from jaxkv.serve import RequestDefaults, create_app
    except ImportError as error:
        raise ValueError(
            f"jaxkv serve needs the serve extra ({error.name} is missing): "
            "pip install 'jaxkv[serve]'"
        ) from None
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
        cache=cache_config(args, num_pages=args.num_pages, int8_pages=args.int8_pages),
        max_slots=args.max_slots,
        max_prefills=args.max_prefills,
        max_batched_tokens=args.max_batched_tokens,
        max_context=args.max_context,
        max_waiting=args.max_waiting,
        max_contexts=args.max_contexts,
        mesh=None if args.mesh is None else mesh_from_text(args.mesh),
        policy_params=params,
        backend=args.backend,
    )
    app = create_app(
        engine,
        tokenizer,
        model_name=args.served_model_name or short_name(args.model),
        policy_spec=args.policy,
        defaults=defaults,
        warm_up_first=not args.no_warm_up,
        auto_context_tokens=args.auto_context_tokens,
        contexts_dir=args.contexts_dir,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
