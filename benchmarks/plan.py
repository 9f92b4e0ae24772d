"""What a request costs, from XLA's own accounting, at real sizes and without a device or weights.

For a model's shapes (`jaxkv.models.configs.MODEL_SHAPES`, e.g. llama-3.1-8b, or a preset), a
context, a batch and each policy, the programs `generate` runs are lowered from abstract shapes
(`jax.ShapeDtypeStruct`: nothing is allocated) and compiled for this machine's backend (the
attention on `--backend`: "xla" by default; "pallas" on an NVIDIA GPU plans the kernels'
programs as that device's compiler assigns their buffers), and XLA reports:

  prefill   chunked prefill + the policy's compression (`prefill_and_compress`);
  repack    the compressed state into its decode geometry (`repack_program`), where it differs
            (none where decode keeps the prefill pool and only its page tables change width:
            `jaxkv.cache.repack.keeps_prefill_pool`);
  decode    the decode loop (`decode_loop`): its memory;
  step      one decode step's reading (`read_tokens`): bytes accessed and flops per token;
  evict     the policy's decode-time eviction (the decode eviction's `on_decode`), run every
            `decode_interval` steps: its bytes and flops apart, and per step amortised.

Bytes accessed are XLA's cost analysis (HloCostAnalysis), neither traffic nor a bound on it:
it counts a loop's body once whatever its trip count (the layer scan: one layer's weights, not
all of them) and charges a gather its whole operand (gathering 8 pages of a 3.3 GB pool counts
3.3 GB; a dynamic slice of the same pages counts 0.8 MB), and the XLA path reads pages by
gathers, block by block. `--memory-only` skips those programs. Memory is XLA's buffer
assignment, which is what a run allocates.
On the CPU, XLA computes bf16 dots in f32 and hoists the weights' conversion out of the layer
loop (a f32 copy of every layer's weights among the temporaries, which GPU and TPU compilers do
not make): plan CPU runs in the dtype they will run in, f32 by default here.

Memory per program (`compiled.memory_analysis()`): arguments, outputs, aliased (donated) bytes
and temporaries; the program's peak is arguments + outputs - aliased + temporaries. The request's
peak is the largest of them, the repack's counted with the weights (they stay resident while it
runs). What the cache holds after compression is planned from the policy's budget (every head at
its average share; policies whose share depends on the data are planned at the whole prompt and
say so). A decode step reads the weights and the KV held once: its bytes are compared with that.

    jaxkv bench plan --model llama-3.1-8b --contexts 32768 130816 --batch 1 \\
        --policies full snapkv:0.25 h2o:0.25 --out results/plan
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import policies
from jaxkv.attention import Backend, check_runs_here
from jaxkv.benchmarks import harness
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig
from jaxkv.cache.repack import device_decode_geometry, keeps_prefill_pool
from jaxkv.generation.loop import decode_loop, decode_tokens_bound, repack_program
from jaxkv.generation.prefill import prefill_and_compress
from jaxkv.generation.request import Prompts, default_prefill_chunk, prefill_geometry
from jaxkv.models import configs
from jaxkv.models.decoder import Model, param_shapes
from jaxkv.sampling import SamplingRows
from jaxkv.step.decode import StepContext, decode_context, read_tokens
from jaxkv.step.rows import Rows

DEFAULT_POLICIES = [
    "full",
    "snapkv:0.25",
    "pyramidkv:0.25",
    "adakv:0.25",
    "tova:0.25",
    "knorm:0.25",
    "streaming_llm:0.25",
    "sliding_window:0.25",
    "h2o:0.25",
    "observed_attention:0.25",
    "scissorhands:0.25",
    "sage_kv:0.25",
    "kvzip:0.25",
    "fastkvzip:0.25",
    "quest:0.25",
    "confkv",
    "gvote",
]


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """XLA's accounting of one compiled program (bytes; flops and bytes accessed per run)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    bytes_accessed: float
    flops: float
    compile_seconds: float

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


def program_cost(lowered) -> ProgramCost:
    """Compiles `lowered` and reads its memory and cost analyses."""
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return ProgramCost(
        arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        aliased=int(memory.alias_size_in_bytes),
        temporaries=int(memory.temp_size_in_bytes),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        flops=float(cost.get("flops", 0.0)),
        compile_seconds=round(seconds, 2),
    )


def abstract(tree):
    """Every array leaf of `tree` as a ShapeDtypeStruct."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def abstract_model(cfg: configs.ModelConfig, dtype) -> Model:
    """A Model whose params are ShapeDtypeStructs of `dtype` (no weights allocated)."""
    params = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, dtype),
        param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return Model(config=cfg, params=params)


def tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def planned_lengths(policy, cfg, context: int, batch: int, budget_tokens) -> tuple[np.ndarray, str]:
    """Tokens each head holds after compression, int [L, B, K] (host), and how it was planned
    (`Policy.planned_tokens`)."""
    held, rule = policy.planned_tokens(budget_tokens, np.full(batch, context))
    shape = (cfg.num_layers, batch, cfg.num_kv_heads)
    return np.broadcast_to(np.asarray(held)[None, :, None], shape).copy(), rule


def _kv_bytes(geometry: dict) -> int:
    return tree_bytes(jax.eval_shape(lambda: KVState.create(**geometry)))


@dataclasses.dataclass(frozen=True)
class _AbstractRequest:
    """The abstract inputs (shapes and dtypes, no data) of one request's programs."""

    model: Model
    prompts: Prompts
    geometry: dict  # the prefill state's KVState.create arguments
    kv: KVState
    lengths: np.ndarray  # int32 [B], the prompts' lengths
    budget_tokens: np.ndarray
    budget: jax.ShapeDtypeStruct
    prompt_share: jax.ShapeDtypeStruct  # f32 [B], the policy's `prompt_share`
    thresholds: jax.ShapeDtypeStruct  # f32 [B, n], the policy's
    params: object  # the policy's abstract parameters, or None
    static: object  # the policy as jit sees it
    key: jax.ShapeDtypeStruct
    rows: jax.ShapeDtypeStruct  # int32 [B]
    backend: Backend  # the attention backend the programs are lowered for


def _abstract_request(
    cfg: configs.ModelConfig, *, context, batch, policy, max_new_tokens, page_size, dtype, backend
) -> _AbstractRequest:
    lengths = np.full(batch, context, np.int32)
    chunk = default_prefill_chunk(policy, lengths)
    num_chunks = -(-context // chunk)
    prompts = Prompts(
        tokens=np.zeros((batch, chunk * num_chunks), np.int32),
        lengths=lengths,
        chunk=chunk,
        num_chunks=num_chunks,
    )
    model = abstract_model(cfg, dtype)
    cache = CacheConfig(page_size=page_size)
    geometry = prefill_geometry(
        model, prompts, max_new_tokens - 1, max_new_tokens, policy, cache, None
    )
    budget_tokens = policy.budget_tokens(lengths)
    part = policy.params
    params = None if part is None else part.init(cfg, jax.random.PRNGKey(0))
    return _AbstractRequest(
        model=model,
        prompts=prompts,
        geometry=geometry,
        kv=jax.eval_shape(lambda: KVState.create(**geometry)),
        lengths=lengths,
        budget_tokens=budget_tokens,
        budget=abstract(jnp.asarray(budget_tokens)),
        prompt_share=abstract(jnp.asarray(policy.prompt_share(batch))),
        thresholds=abstract(jnp.asarray(policy.thresholds(batch))),
        params=None if params is None else abstract(params),
        static=policy.static(),
        key=jax.ShapeDtypeStruct((2,), jnp.uint32),
        rows=jax.ShapeDtypeStruct((batch,), jnp.int32),
        backend=backend,
    )


def _prefill_cost(r: _AbstractRequest) -> ProgramCost:
    """Chunked prefill and compression, one program."""
    return program_cost(
        prefill_and_compress.jitted.lower(
            model=r.model,
            tokens=abstract(r.prompts.tokens),
            lengths=r.rows,
            num_chunks=jax.ShapeDtypeStruct((), jnp.int32),
            budget_tokens=r.budget,
            prompt_share=r.prompt_share,
            thresholds=r.thresholds,
            kv=r.kv,
            key=r.key,
            policy_params=r.params,
            chunk=r.prompts.chunk,
            policy=r.static,
            int8_window=None,
            backend=r.backend,
        )
    )


def _decode_cost(r: _AbstractRequest, policy, decode_kv: KVState, max_new_tokens: int):
    """The decode loop's program."""
    batch = len(r.lengths)
    return program_cost(
        decode_loop.jitted.lower(
            model=r.model,
            kv=decode_kv,
            last_hidden=jax.ShapeDtypeStruct((batch, r.model.config.hidden_size), r.model.dtype),
            rows=_abstract_rows(r, policy),
            max_new_tokens=jax.ShapeDtypeStruct((), jnp.int32),
            stop_tokens=jax.ShapeDtypeStruct((1,), jnp.int32),
            policy_params=r.params,
            listener=None,
            steps_bucket=max_new_tokens,
            policy=r.static,
            pad_id=0,
            backend=r.backend,
        )
    )


def _budget_ratio(policy, batch: int) -> jax.ShapeDtypeStruct:
    return abstract(jnp.asarray(policy.budget_ratio(batch)))


def _abstract_rows(r: _AbstractRequest, policy) -> Rows:
    """The decode's per-row state (`jaxkv.step.rows.Rows`), abstract."""
    batch = len(r.lengths)
    per_row = jax.ShapeDtypeStruct((batch,), jnp.float32)
    return Rows(
        prompt_lengths=r.rows,
        budget_tokens=r.budget,
        budget_ratio=_budget_ratio(policy, batch),
        thresholds=r.thresholds,
        keys=jax.ShapeDtypeStruct((batch, 2), jnp.uint32),
        steps=r.rows,
        positions=r.rows,
        sampling=SamplingRows(temperature=per_row, top_k=r.rows, top_p=per_row),
    )


def _read_costs(r: _AbstractRequest, policy, decode_kv: KVState) -> dict[str, ProgramCost | None]:
    """One decode step's reading, and the eviction apart (None if it never evicts)."""
    cfg, batch = r.model.config, len(r.lengths)
    context_arrays = StepContext(
        rows=_abstract_rows(r, policy),
        policy_params=r.params,
        policy=r.static,
        backend=r.backend,
    )
    step = program_cost(
        jax.jit(read_tokens, donate_argnums=1).lower(
            r.model, decode_kv, r.rows, r.rows, context_arrays
        )
    )
    evict = None
    eviction = r.static.decode_eviction
    if eviction is not None:

        def on_decode(kv, ctx, positions, logits):
            return eviction.on_decode(kv, decode_context(ctx, positions, logits, cfg.group_size))

        logits = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32)
        evict = program_cost(
            jax.jit(on_decode, donate_argnums=0).lower(decode_kv, context_arrays, r.rows, logits)
        )
    return {"step": step, "evict": evict}


def plan_request(
    cfg: configs.ModelConfig,
    *,
    context: int,
    batch: int,
    policy,
    max_new_tokens: int,
    page_size: int,
    dtype,
    reads: bool = True,
    backend: Backend = Backend.XLA,
) -> dict:
    """The plan of one request (module docstring); sizes in bytes. `reads=False` plans memory
    alone: the step and eviction programs (XLA's bytes accessed) are not compiled, and their
    fields are None."""
    r = _abstract_request(
        cfg,
        context=context,
        batch=batch,
        policy=policy,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        dtype=dtype,
        backend=backend,
    )
    prefill = _prefill_cost(r)
    held, held_rule = planned_lengths(policy, cfg, context, batch, r.budget_tokens)
    held_per_head = np.asarray(held, np.float64).mean(axis=(0, 2))
    bound = decode_tokens_bound(policy, r.budget_tokens, r.lengths, max_new_tokens, held_per_head)
    num_pages, max_pages = device_decode_geometry(held, bound, max_new_tokens, page_size)
    keeps_pool = keeps_prefill_pool(r.geometry["num_pages"], num_pages)
    if keeps_pool:  # as generate decides (to_decode_geometry)
        num_pages = r.geometry["num_pages"]
    decode_geometry = dict(r.geometry, num_pages=num_pages, max_tokens=max_pages * page_size)
    decode_kv = jax.eval_shape(lambda: KVState.create(**decode_geometry))
    repack = None
    prefill_geometry = (r.geometry["num_pages"], r.geometry["max_tokens"])
    if not keeps_pool and (num_pages, max_pages * page_size) != prefill_geometry:
        repack = program_cost(
            repack_program.jitted.lower(
                kv=r.kv, num_pages=num_pages, max_pages=max_pages, int8_geometry=None
            )
        )
    decode = _decode_cost(r, policy, decode_kv, max_new_tokens)
    programs = {"prefill": prefill, "repack": repack, "decode": decode, "step": None, "evict": None}
    if reads:
        programs |= _read_costs(r, policy, decode_kv)
    weights = tree_bytes(r.model.params)
    prefill_kv, held_kv = _kv_bytes(r.geometry), _kv_bytes(decode_geometry)
    peaks = [prefill.peak, decode.peak]
    if repack is not None:
        peaks.append(weights + repack.peak)
    step, evict = programs["step"], programs["evict"]
    interval = r.static.decode_eviction.decode_interval if evict is not None else None
    step_bytes = None
    if reads:
        step_bytes = step.bytes_accessed + (evict.bytes_accessed / interval if evict else 0.0)
    return {
        "policy": policy.name,
        "context": context,
        "batch": batch,
        "max_new_tokens": max_new_tokens,
        "weights_bytes": weights,
        "prefill_kv_bytes": prefill_kv,
        "decode_kv_bytes": held_kv,
        "held_rule": held_rule,
        "peak_bytes": max(peaks),
        "peak_over_weights_and_kv": max(peaks) / (weights + max(prefill_kv, held_kv)),
        "step_bytes_accessed": step_bytes,
        "step_bytes_over_weights_and_kv": (
            None if step_bytes is None else step_bytes / (weights + held_kv)
        ),
        "evict_interval": interval,
        "programs": {
            name: None if cost is None else {**dataclasses.asdict(cost), "peak": cost.peak}
            for name, cost in programs.items()
        },
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _reads(row: dict) -> str:
    if row["step_bytes_accessed"] is None:
        return "- | -"  # planned with --memory-only
    return f"{row['step_bytes_accessed'] / 1e9:.1f} | {row['step_bytes_over_weights_and_kv']:.2f}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| policy | context x batch | weights GiB | prefill KV GiB | decode KV GiB | peak GiB "
        "| peak / (weights + KV) | step GB accessed | accessed / (weights + KV held) "
        "| KV planned as |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['context']} x {r['batch']} | {_gib(r['weights_bytes'])} "
            f"| {_gib(r['prefill_kv_bytes'])} | {_gib(r['decode_kv_bytes'])} "
            f"| {_gib(r['peak_bytes'])} | {r['peak_over_weights_and_kv']:.3f} "
            f"| {_reads(r)} "
            f"| {r['held_rule']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench plan", description=__doc__)
    names = sorted(configs.MODEL_SHAPES) + sorted(configs.PRESETS)
    parser.add_argument("--model", default="llama-3.1-8b", choices=names)
    # 128K: the model's 131072 positions less the 256 new tokens.
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 130816])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=sorted(configs.SUPPORTED_DTYPES))
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="plan memory alone: skips the step and eviction programs (bytes accessed)",
    )
    parser.add_argument(
        "--backend",
        default="xla",
        choices=[backend.value for backend in Backend],
        help="the attention backend the programs are lowered for (pallas: on an NVIDIA GPU)",
    )
    parser.add_argument("--out", type=Path, default=None, help="writes plan.json and plan.md")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        backend = check_runs_here(args.backend)
    except ValueError as error:
        raise SystemExit(f"--backend {args.backend}: {error}") from None
    cfg = configs.model_shape(args.model)
    dtype = configs.dtype_from_name(args.dtype)
    for context in args.contexts:
        if not 1 <= context <= cfg.max_position_embeddings - args.max_new_tokens:
            raise SystemExit(
                f"--contexts {context}: {args.model} takes 1 to "
                f"{cfg.max_position_embeddings - args.max_new_tokens} tokens before "
                f"{args.max_new_tokens} new ones"
            )
    specs = []
    for spec in args.policies:
        try:
            policy = policies.from_spec(spec)
            policy.budget_tokens(np.asarray(args.contexts))  # a missing budget is named here
        except ValueError as error:
            raise SystemExit(f"--policies {spec}: {error}") from None
        if policy.admission is not None:
            raise SystemExit(
                f"--policies {spec}: not planned from shapes: an admission policy's pool grows "
                "on the host chunk by chunk with what it admits (data)"
            )
        specs.append(policy)
    rows = []
    for context in args.contexts:
        for policy in specs:
            row = plan_request(
                cfg,
                context=context,
                batch=args.batch,
                policy=policy,
                max_new_tokens=args.max_new_tokens,
                page_size=args.page_size,
                dtype=dtype,
                reads=not args.memory_only,
                backend=backend,
            )
            rows.append(row)
            print(markdown_table([row]).splitlines()[-1], flush=True)
    report = {
        **harness.provenance("jaxkv bench plan", argv),
        "model": args.model,
        "backend": jax.default_backend(),
        "attention_backend": backend.value,
        "rows": rows,
    }
    table = markdown_table(rows)
    print(table)
    if args.out is not None:
        harness.save(args.out, "plan", report, table)
    return report


if __name__ == "__main__":
    main()
