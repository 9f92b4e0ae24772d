"""Many questions over a few documents (SCBench's shape of traffic): `jaxkv.Engine` with its
context cache against the same policy without it, per policy, over one Poisson trace.

    jaxkv bench serve_contexts --model smollm2-135m-instruct \
        --policies kvzip:0.3 fastkvzip:0.3 full --documents 8 --questions 8 \
        --out results/serve-contexts

The trace: `--documents` documents of `--min-document`..`--max-document` tokens of prose
(`jaxkv.prose`, in the model's chat template where it has one: the document is the user turn's
content, each question follows it, as `jaxkv ask --chat` splits them; plain text otherwise),
`--questions` questions each (one of `QUESTIONS` in turn), `--min-new`..`--max-new` new tokens
each (stop tokens off, so every request runs its length), arriving as a Poisson process of
`--rate` requests per second of wall time in a random order that interleaves the documents;
the same trace for every run. Each policy runs twice over one pool of `--pool-requests`
full-cache requests of the longest document, question and answer (with `--storage int8`, an
int8 tier's pool of as many pages beside it):
  cached    the first question of a document adds its context (`Engine.add_context`: prefilled
            and compressed once), every question reads it (`submit(..., context=)`; a context
            dropped for its pages is added again);
  uncached  every request prefills and compresses its whole prompt, document and question.
The full cache's cached run is exact prefix reuse (nothing is compressed). Per run: requests per
second (end to end), time to first token (p50, p99) of every request and of those whose context
was ready when they arrived (the cache's hits), time per output token, the KV bytes a request
held at its end (mean), contexts dropped for pages, and, for a cached run, how many answers
equal `jaxkv.ask`'s over the same document and question (greedy, token for token). The report
is written again as each run ends. Run on one machine in one process: ratios between runs are
the measurement.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness
from jaxkv.engine import ContextEvent, UnknownContextError
from jaxkv.model_sources import load_model
from jaxkv.models import chat_halves
from jaxkv.policies import spec as spec_lib
from jaxkv.prose import prose

QUESTIONS = (
    "What is the text about?",
    "Summarize the text in one sentence.",
    "Which Python feature does the text describe first?",
    "Name one function or module the text mentions.",
    "What is the last topic of the text?",
    "Give the text a title.",
    "What example does the text give?",
    "Who would read this text?",
)


def build_trace(tokenizer, args) -> tuple[list[list[int]], list[dict]]:
    """(each document's context ids, [{arrival, document, question ids, max_new_tokens}]),
    deterministic in --seed."""
    rng = np.random.default_rng(args.seed)
    before, after = chat_halves(tokenizer) if tokenizer.chat_template else ("", "")
    documents = []
    for index in range(args.documents):
        length = int(rng.integers(args.min_document, args.max_document + 1))
        text = tokenizer.decode(
            tokenizer.encode(prose(length * 8, seed=args.seed + index))[:length]
        )
        documents.append(tokenizer.encode(before + text, add_bos=False))
    pairs = [(d, q) for d in range(args.documents) for q in range(args.questions)]
    order = rng.permutation(len(pairs))
    gaps = rng.exponential(1.0 / args.rate, len(pairs))
    trace, arrival = [], 0.0
    for position, pair in enumerate(order):
        document, question = pairs[pair]
        arrival += float(gaps[position]) if position else 0.0
        text = "\n\n" + QUESTIONS[question % len(QUESTIONS)] + after
        trace.append(
            {
                "arrival": arrival,
                "document": document,
                "question": tokenizer.encode(text, add_bos=False),
                "max_new_tokens": int(rng.integers(args.min_new, args.max_new + 1)),
            }
        )
    return documents, trace


def run(model, policy, documents, trace, args, num_pages: int, params, cached: bool) -> dict:
    """One pass of the trace through a fresh engine (module docstring): its measures and each
    request's tokens (in trace order)."""
    engine = jaxkv.Engine(
        model,
        policy,
        cache=cache_config(args, num_pages=num_pages),
        max_slots=args.max_slots,
        max_contexts=args.documents if cached else 0,
        max_context=args.max_document + 64 + args.max_new,
        policy_params=params,
    )
    warm_up(engine, documents[0], trace[0], cached)
    contexts, ready = {}, set()  # document -> context id; context ids ready
    submitted, first, last, counts, hits, tokens, kv_bytes = {}, {}, {}, {}, set(), {}, []
    evicted = 0
    pending = list(enumerate(trace))
    start = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][1]["arrival"] <= now:
            index, request = pending.pop(0)
            rid, hit = submit(engine, request, documents, contexts, ready, cached)
            submitted[rid], tokens[rid] = (start + request["arrival"], index), []
            if hit:
                hits.add(rid)
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][1]["arrival"] - now))
            continue
        events = engine.step()
        step_end = time.perf_counter()
        for event in events:
            if isinstance(event, ContextEvent):
                if event.state == "ready":
                    ready.add(event.context_id)
                else:
                    ready.discard(event.context_id)
                    evicted += event.state == "evicted"
                continue
            if event.token >= 0:
                first.setdefault(event.request_id, step_end)
                last[event.request_id] = step_end
                counts[event.request_id] = counts.get(event.request_id, 0) + 1
                tokens[event.request_id].append(event.token)
            if event.finished and event.kv_bytes is not None:
                kv_bytes.append(event.kv_bytes)
    elapsed = time.perf_counter() - start
    ttft = {rid: first[rid] - submitted[rid][0] for rid in submitted}
    tpot = [(last[rid] - first[rid]) / max(counts[rid] - 1, 1) for rid in submitted]
    hit_ttft = [ttft[rid] for rid in hits] or [np.nan]
    return {
        "requests": len(submitted),
        "requests_per_second": len(submitted) / elapsed,
        "ttft_p50": float(np.percentile(list(ttft.values()), 50)),
        "ttft_p99": float(np.percentile(list(ttft.values()), 99)),
        "hits": len(hits),
        "hit_ttft_p50": float(np.percentile(hit_ttft, 50)),
        "tpot_p50": float(np.percentile(tpot, 50)),
        "kv_bytes_mean": float(np.mean(kv_bytes)),
        "contexts_evicted": evicted,
        "seconds": elapsed,
        "tokens": {submitted[rid][1]: tokens[rid] for rid in submitted},
    }


def cache_config(args, **more) -> jaxkv.CacheConfig:
    """The engine's and `ask`'s storage: --storage (int8: each head's newest
    --full-precision-window tokens in the kv dtype; its int8 pool as large as the pool)."""
    if args.storage == "int8":
        more["full_precision_window"] = args.full_precision_window
    return jaxkv.CacheConfig(storage=args.storage, **more)


def warm_up(engine, document, request, cached: bool) -> None:
    """Compiles the programs of a pass before the clock starts (`Engine.warm_up`'s prompt
    programs, then a document, a question and its decode as the pass runs them); the engine
    is left empty."""
    engine.warm_up()
    request = {**request, "document": 0, "max_new_tokens": 2}
    contexts: dict = {}
    submit(engine, request, [document], contexts, set(), cached)
    engine.run()
    for context in contexts.values():
        engine.drop_context(context)


def submit(engine, request, documents, contexts: dict, ready: set, cached: bool):
    """The request into the engine: (its id, whether its document's context was ready)."""
    document = documents[request["document"]]
    options = {"max_new_tokens": request["max_new_tokens"], "stop_tokens": ()}
    if not cached:
        return engine.submit(document + request["question"], **options), False
    for _ in range(2):  # a context dropped for its pages is added again
        if request["document"] not in contexts:
            contexts[request["document"]] = engine.add_context(document)
        context = contexts[request["document"]]
        try:
            rid = engine.submit(request["question"], context=context, **options)
        except UnknownContextError:
            del contexts[request["document"]]
            continue
        return rid, context in ready
    raise RuntimeError("a context added now was dropped at once")


def ask_tokens(model, policy, documents, trace, args, params) -> dict[int, list[int]]:
    """`jaxkv.ask`'s greedy answer to each request of the trace (its max_new_tokens)."""
    answers = {}
    for document, context in enumerate(documents):
        indices = [i for i, request in enumerate(trace) if request["document"] == document]
        out = jaxkv.ask(
            model,
            context,
            [trace[i]["question"] for i in indices],
            policy,
            max_new_tokens=args.max_new,
            stop_tokens=(),
            policy_params=params,
            cache=cache_config(args),
        ).answers
        for row, index in enumerate(indices):
            answers[index] = out.tokens[row, : trace[index]["max_new_tokens"]].tolist()
    return answers


def markdown(report: dict) -> str:
    head = (
        "| policy | context cache | req/s | TTFT p50 / p99 s | hits: TTFT p50 s | TPOT p50 s "
        "| KV bytes a request (mean) | contexts dropped | answers = ask's |"
    )
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        equal = "" if row["equal_to_ask"] is None else f"{row['equal_to_ask']}/{row['requests']}"
        rows.append(
            f"| {row['policy']} | {'yes' if row['cached'] else 'no'} "
            f"| {row['requests_per_second']:.3f} "
            f"| {row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} "
            f"| {row['hits']}: {row['hit_ttft_p50']:.2f} | {row['tpot_p50']:.3f} "
            f"| {row['kv_bytes_mean'] / 2**20:.1f} MiB | {row['contexts_evicted']} | {equal} |"
        )
    ratios = ["", "| policy | req/s, cached / uncached | TTFT p50 of hits / uncached p50 |"]
    ratios.append("|---|---|---|")
    for policy in dict.fromkeys(row["policy"] for row in report["rows"]):
        pair = {row["cached"]: row for row in report["rows"] if row["policy"] == policy}
        if len(pair) == 2:
            speed = pair[True]["requests_per_second"] / pair[False]["requests_per_second"]
            ttft = pair[True]["hit_ttft_p50"] / pair[False]["ttft_p50"]
            ratios.append(f"| {policy} | {speed:.2f}x | {ttft:.3f}x |")
    title = f"# Many questions over a few documents ({report['model']})"
    return (
        f"{title}\n\n{harness.provenance_line(report['provenance'])}\n\n"
        + "\n".join(rows + ratios)
        + "\n"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench serve_contexts",
        description=__doc__,
        formatter_class=harness.HelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help=harness.MODEL_HELP)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["kvzip:0.3", "fastkvzip:0.3", "full"],
        help="policy specs, a cached and an uncached run each over the same trace",
    )
    parser.add_argument("--documents", type=int, default=8, help="documents in the trace")
    parser.add_argument("--questions", type=int, default=8, help="questions per document")
    parser.add_argument("--min-document", type=int, default=1536, help="shortest, tokens")
    parser.add_argument("--max-document", type=int, default=2048, help="longest, tokens")
    parser.add_argument("--min-new", type=int, default=16, help="fewest new tokens a request")
    parser.add_argument("--max-new", type=int, default=48, help="most new tokens a request")
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    parser.add_argument(
        "--pool-requests",
        type=int,
        default=4,
        help="the pool, in full-cache requests of the longest document + question + answer",
    )
    parser.add_argument("--max-slots", type=int, default=16, help="requests decoded at once")
    parser.add_argument(
        "--storage",
        choices=("model", "int8"),
        default="model",
        help="the cache's storage: every token in the kv dtype, or each head's older ones int8",
    )
    parser.add_argument(
        "--full-precision-window",
        type=int,
        default=jaxkv.CacheConfig().full_precision_window,
        help="with --storage int8, the newest tokens a head keeps in the kv dtype",
    )
    harness.add_params_option(parser)
    parser.add_argument("--seed", type=int, default=0, help="the trace's documents and arrivals")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/serve-contexts"),
        help="where serve_contexts.json and .md go, in a folder per model",
    )
    args = parser.parse_args(argv)
    for name in ("documents", "questions", "pool_requests", "min_new"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: at least 1")
    given = spec_lib.parse_params(args.params)
    model, tokenizer = load_model(args.model)
    documents, trace = build_trace(tokenizer, args)
    cfg, page_size = model.config, jaxkv.CacheConfig().page_size
    longest = max(map(len, documents)) + max(len(r["question"]) for r in trace) + args.max_new
    num_pages = args.pool_requests * cfg.num_layers * cfg.num_kv_heads * -(-longest // page_size)
    report = {
        "provenance": harness.provenance("jaxkv bench serve_contexts", argv),
        "model": args.model,
        "trace": {key: value for key, value in vars(args).items() if key != "out"},
        "questions": list(QUESTIONS),
        "rows": [],
    }
    out = args.out / Path(args.model).stem
    for spec in args.policies:
        policy = policies.from_spec(spec).for_tokenizer(tokenizer)
        params = harness.learned_params(policy, model, args.model, given)
        asked = ask_tokens(model, policy, documents, trace, args, params)
        for cached in (True, False):
            result = run(model, policy, documents, trace, args, num_pages, params, cached)
            answers = result.pop("tokens")
            equal = sum(answers[i] == asked[i] for i in answers) if cached else None
            row = {"policy": spec, "cached": cached, "num_pages": num_pages, **result}
            row["equal_to_ask"] = equal
            harness.print_row(row)
            report["rows"].append(row)
            harness.save(out, "serve_contexts", report, markdown(report))  # each run as it ends
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
