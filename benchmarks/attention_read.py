"""How fast XLA's decode attention reads K and V on this backend: paged, dense, and a plain read.

One decode step's attention over every layer of a shape (default: the system benchmark's
cpu-kv, 4 layers of 8 KV heads x 128 in f32, one query per head) over `context` tokens a head,
measured four ways over the same bytes of K and V in one process, interleaved:
  read        row sums of K and V as their [tokens, head_dim] rows: the bytes and nothing else;
  read_wide   the same bytes as rows of `harness.READ_ROW` floats: `harness.read_bandwidth`,
              the system benchmark's roofline probe;
  dense       attention over contiguous [B, K, T, H] K and V (the textbook formula in jnp);
  paged_*     `jaxkv.attention.paged_attention` (backend "xla") over the same tokens in pages
              of one pool for all layers, the page ids laid out three ways: `ordered` (each
              head's pages consecutive, as `repack` leaves them), `prefill` (runs of
              --prefill-chunk tokens, in the order a chunked prefill allocates them: chunk by
              chunk, layer by layer, head by head) and `shuffled` (every page anywhere).
Each is `harness.seconds_per_call` (median over --repeats of 10 calls); the rounds interleave
the four so that drift hits all alike. Reports ms per step, GB/s of K and V, and the ratios
that say what bounds a step's attention: paged / dense (the cost of reading through a page
table, by layout) and read / dense (how far the attention is from reading its bytes). Every
paged output is compared with the dense one before timing (they must agree to 1e-4).

    jaxkv bench attention_read --contexts 1024 4096 --batch 4 \\
        --out results/system/cpu-kv/attention-read
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import paged_attention
from jaxkv.benchmarks import harness

LAYOUTS = ("ordered", "prefill", "shuffled")
WAYS = ("read", "read_wide", "dense", *(f"paged_{layout}" for layout in LAYOUTS))


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float) -> jax.Array:
    """Softmax attention of q [B, K, G, H] (G query heads per KV head, one token each) over
    contiguous k, v [B, K, T, H]: out f32 [B, K, G, H]."""
    scores = jnp.einsum("bkgh,bkth->bkgt", q, k) * sm_scale
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgt,bkth->bkgh", probs, v)


def page_table(layout: str, shape: tuple[int, int, int, int], run: int, seed: int) -> np.ndarray:
    """int32 [L, B, K, pages] over a pool of L * B * K * pages pages, laid out as `layout`
    (module docstring); `run`: pages a prefill chunk allocates a head at once."""
    layers, batch, heads, pages = shape
    if layout == "ordered":
        return np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    if layout == "shuffled":
        ids = np.random.default_rng(seed).permutation(np.prod(shape))
        return ids.reshape(shape).astype(np.int32)
    chunks = -(-pages // run)
    order = np.arange(chunks * layers * batch * heads * run).reshape(
        chunks, layers, batch, heads, run
    )
    table = order.transpose(1, 2, 3, 0, 4).reshape(layers, batch, heads, chunks * run)
    table = table[..., :pages]
    ranks = np.argsort(np.argsort(table.reshape(-1)))  # dense ids 0..P-1, allocation order kept
    return ranks.reshape(shape).astype(np.int32)


def step_inputs(args, context: int) -> dict:
    """Random K and V of every layer, dense [L][B, K, T, H] and paged in each layout (pools
    [P, p, H] and tables [L][B, K, T / p]), and one query per head [L][B, K, G, H]."""
    layers, b, kv_heads, h = args.layers, args.batch, args.kv_heads, args.head_dim
    p = args.page_size
    pages = context // p
    key_k, key_v, key_q = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (layers, b, kv_heads, context, h)
    k = jax.random.normal(key_k, shape, jnp.float32)
    v = jax.random.normal(key_v, shape, jnp.float32)
    q = jax.random.normal(key_q, (layers, b, kv_heads, args.group, h), jnp.float32)
    inputs = {"q": list(q), "k": list(k), "v": list(v)}
    inputs["lengths"] = jnp.full((b, kv_heads), context, jnp.int32)
    run = max(1, args.prefill_chunk // p)
    for layout in LAYOUTS:
        table = page_table(layout, (layers, b, kv_heads, pages), run, seed=context)
        ids = table.reshape(-1)
        inputs[layout] = {
            "k_pool": jnp.zeros((ids.size, p, h), jnp.float32).at[ids].set(k.reshape(-1, p, h)),
            "v_pool": jnp.zeros((ids.size, p, h), jnp.float32).at[ids].set(v.reshape(-1, p, h)),
            "tables": list(jnp.asarray(table)),
        }
    return inputs


def programs(args) -> dict:
    """The four ways, each a jitted function of `step_inputs`' fields over all layers."""
    sm_scale = args.head_dim**-0.5

    def read(k, v):
        return [jnp.sum(x, axis=-1) for x in (*k, *v)]

    def dense(q, k, v):
        return [dense_attention(*layer, sm_scale) for layer in zip(q, k, v, strict=True)]

    def paged(q, k_pool, v_pool, tables, lengths):
        outs = []
        for query, table in zip(q, tables, strict=True):
            b, kv_heads, group, h = query.shape
            out, _ = paged_attention(
                query.reshape(b, kv_heads * group, 1, h),
                k_pool,
                v_pool,
                table,
                lengths,
                sm_scale=sm_scale,
                backend="xla",
            )
            outs.append(out.reshape(b, kv_heads, group, h))
        return outs

    paged = jax.jit(paged)
    return {"read": jax.jit(read), "dense": jax.jit(dense)} | {
        f"paged_{layout}": paged for layout in LAYOUTS
    }


def _arguments(way: str, inputs: dict) -> tuple:
    if way == "read":
        return inputs["k"], inputs["v"]
    if way == "dense":
        return inputs["q"], inputs["k"], inputs["v"]
    layout = inputs[way.removeprefix("paged_")]
    return inputs["q"], layout["k_pool"], layout["v_pool"], layout["tables"], inputs["lengths"]


def check_agreement(fns: dict, inputs: dict) -> float:
    """The largest |paged - dense| over every layout's and layer's output; raises above 1e-4."""
    dense = fns["dense"](*_arguments("dense", inputs))
    error = 0.0
    for layout in LAYOUTS:
        paged = fns[f"paged_{layout}"](*_arguments(f"paged_{layout}", inputs))
        error = max(
            error, *(float(jnp.max(jnp.abs(a - b))) for a, b in zip(dense, paged, strict=True))
        )
        if error > 1e-4:
            raise AssertionError(f"paged attention ({layout}) differs from dense by {error:.2e}")
    return error


def measure(args, context: int) -> dict:
    """One context's row: each way's seconds per step (interleaved rounds) and rates."""
    inputs = step_inputs(args, context)
    fns = programs(args)
    error = check_agreement(fns, inputs)
    kv_bytes = 2 * sum(x.size * x.dtype.itemsize for x in inputs["k"])
    times = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            if way == "read_wide":
                times[way].append(kv_bytes / harness.read_bandwidth(kv_bytes, args.repeats))
            else:
                fn = fns[way]
                seconds = harness.seconds_per_call(
                    fn, *_arguments(way, inputs), repeats=args.repeats
                )
                times[way].append(seconds)
    best = {way: min(values) for way, values in times.items()}
    row = {
        "context": context,
        "batch": args.batch,
        "kv_bytes": kv_bytes,
        "max_abs_paged_minus_dense": error,
        "seconds": times,
    }
    for way in WAYS:
        row[f"{way}_ms"] = 1e3 * best[way]
        row[f"{way}_gbs"] = kv_bytes / best[way] / 1e9
    for layout in LAYOUTS:
        row[f"paged_{layout}_over_dense"] = best[f"paged_{layout}"] / best["dense"]
    row["read_over_dense"] = best["read"] / best["dense"]
    row["read_wide_over_dense"] = best["read_wide"] / best["dense"]
    return row


COLUMNS = (
    ("context", "context", "{}"),
    ("batch", "batch", "{}"),
    ("KV MiB", "kv_bytes", "mib"),
    ("read ms", "read_ms", "{:.2f}"),
    ("read_wide ms", "read_wide_ms", "{:.2f}"),
    ("dense ms", "dense_ms", "{:.2f}"),
    *((f"paged {layout} ms", f"paged_{layout}_ms", "{:.2f}") for layout in LAYOUTS),
    ("read GB/s", "read_gbs", "{:.1f}"),
    ("read_wide GB/s", "read_wide_gbs", "{:.1f}"),
    ("dense GB/s", "dense_gbs", "{:.1f}"),
    *((f"{layout} / dense", f"paged_{layout}_over_dense", "{:.2f}") for layout in LAYOUTS),
    ("read / dense", "read_over_dense", "{:.2f}"),
    ("read_wide / dense", "read_wide_over_dense", "{:.2f}"),
)


def markdown(report: dict) -> str:
    lines = [
        "# Decode attention's read rate: paged, dense and a plain read",
        "",
        f"{report['machine']['device']} ({report['machine']['host']}), jax {report['jax']}, "
        f"{report['date']}.",
        "",
        f"`{report['command']}`",
        "",
        report["method"],
        "",
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    for row in report["rows"]:
        cells = [
            f"{row[key] / 2**20:.1f}" if fmt == "mib" else fmt.format(row[key])
            for _, key, fmt in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench attention_read",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=1, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--prefill-chunk", type=int, default=512, help="tokens a prefill chunk allocates a head"
    )
    parser.add_argument("--repeats", type=int, default=5, help="medians of 10 calls, per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the fastest)")
    parser.add_argument("--out", default="attention-read", help="output prefix: .json, .md")
    return parser


def parse_args(argv) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    names = ("batch", "layers", "kv_heads", "group", "head_dim", "prefill_chunk", "repeats")
    for name in (*names, "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        raise SystemExit("--page-size must be a positive power of two")
    for context in args.contexts:
        if context < args.page_size or context % args.page_size:
            raise SystemExit(
                f"--contexts: {context} must be a positive multiple of --page-size "
                f"({args.page_size})"
            )
    return args


METHOD = (
    "Each way: the fastest over interleaved rounds of the median of --repeats x 10 calls "
    "(`harness.seconds_per_call`); GB/s = bytes of K and V / time. read: row sums of K and V "
    "([tokens, head_dim] rows); read_wide: `harness.read_bandwidth` over the same bytes (rows "
    "of 1024 floats, the system benchmark's roofline probe); dense: softmax attention of one "
    "query per head over contiguous K and V; paged_*: `paged_attention` on 'xla' over one pool "
    "for all layers, each head's pages consecutive (ordered), in runs of --prefill-chunk "
    "tokens as a chunked prefill allocates them (prefill), or anywhere (shuffled); outputs "
    "checked against dense to 1e-4."
)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    rows = [measure(args, context) for context in args.contexts]
    report = {
        "benchmark": "attention_read",
        **harness.provenance("jaxkv bench attention_read", argv),
        "shape": {
            name: getattr(args, name)
            for name in (
                "layers",
                "kv_heads",
                "group",
                "head_dim",
                "page_size",
                "prefill_chunk",
                "batch",
            )
        },
        "method": METHOD,
        "rows": rows,
    }
    out = Path(args.out)
    text = markdown(report)
    harness.save(out.parent, out.stem, report, text)
    print(text)
    return report


if __name__ == "__main__":
    main()
