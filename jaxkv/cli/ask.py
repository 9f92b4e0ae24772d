"""`jaxkv ask`: several questions over one compressed copy of a long context."""

from __future__ import annotations

import json

from jaxkv.cli.options import (
    PrefillProgress,
    add_model_options,
    cache_config,
    policy_before_loading,
    policy_params,
    read_text,
    timings,
)


def add_parser(commands) -> None:
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
    add_model_options(ask, max_new_tokens=64)
    ask.set_defaults(run=run)


def run(args) -> int:
    import jax

    import jaxkv
    from jaxkv.generation.decoding import check_shared_decode
    from jaxkv.model_sources import load_model, stop_tokens
    from jaxkv.models import chat_halves

    if not args.question:
        raise ValueError("give at least one --question")
    policy = policy_before_loading(args)
    sampler = jaxkv.Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    check_shared_decode(policy, args.max_new_tokens)
    cache = cache_config(args)
    context = read_text(args.context, "--context")
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
