"""`generate` (`decode(prefill(...))`), `compress_prompt` (`prefill(...).kv`) and `ask` (one
compressed context, many questions, one copy of the context)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig, check_count
from jaxkv.cache.sharing import shared_and_own_bytes
from jaxkv.compile_log import counting_compiles
from jaxkv.generation.decoding import (
    GenerateOutput,
    check_shared_decode,
    run_decode,
    sampling_key,
)
from jaxkv.generation.request import PromptIds, checked_stop_tokens, resolved_policy
from jaxkv.generation.session import Session, prefill, prefill_session
from jaxkv.model_sources import stop_tokens
from jaxkv.models import Tokenizer, encode_chat
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler


def generate(
    model: Model,
    prompt_ids: PromptIds,
    *,
    max_new_tokens: int,
    policy: Policy | str | None = None,
    sampler: Sampler | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    backend: str | Backend = "auto",
    policy_params: PolicyParams | None = None,
    mesh: jax.sharding.Mesh | None = None,
    on_token: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
    on_prefill_chunk: Callable[[int, int], None] | None = None,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens for a batch of prompts of different lengths.

    Args:
      model: the model (config + params).
      prompt_ids: one prompt (list of ids) or a batch (list of lists, or an int array [B, T]).
      policy: cache policy, or its spec ("snapkv:0.25", `policies.from_spec`); default: keep
        everything.
      sampler: default greedy. A PRNG `key` is required when the sampler is not greedy.
      stop_tokens: ids that end a sequence (default: the config's eos ids).
      cache: how the paged cache holds tokens (`jaxkv.CacheConfig`: page size, pool pages,
        kv dtype, int8 storage; default CacheConfig()). The pool defaults to what the policy
        holds during prefill (a full cache: the whole request). After prefill and compression
        the state moves into a pool and page tables sized for what it holds plus the
        generation, bounded by the policy's budget where it evicts during decode (at most
        cache.num_pages), so the decode loop holds and reads only that. The prefill state is
        donated: its pool is freed before decoding starts.
      prefill_chunk: tokens per prefill chunk (default: the policy's choice, else 512).
      backend: "auto" (default: the Pallas kernels on a GPU, XLA on a CPU or TPU), "xla",
        "pallas" or "interpret" (`jaxkv.attention.Backend`).
      policy_params: the policy's learned parameters (gates), leaves stacked [L, ...]; checked
        against the model by `policy.check_params`.
      mesh: a (data, model) device mesh (`jaxkv.sharding.make_inference_mesh`) to run on:
        batch rows split over "data", KV heads (with their query heads and MLP columns) over
        "model"; each device holds the pages of its own rows and heads, and `cache.num_pages` is per
        device. Tokens equal one device's, sampled ones too (each row draws with its own key).
        None: one device.
      on_token: `on_token(step, tokens int32 [B], done bool [B])`, called in order as the
        jitted decode loop samples each step's tokens (streaming; one device).
      on_prefill_chunk: `on_prefill_chunk(chunks done, chunks in all)`, called after each
        prefill chunk (progress on a long prompt); given, a prompt of several chunks is
        prefilled one program call per chunk (the same tokens and cache).
    Shapes that depend on the request (pool and table sizes, prompt padding, max_new_tokens)
    are bucketed (`jaxkv.cache.geometry`), so a stream of requests compiles a bounded number of
    times; budgets travel as arrays and never recompile.
    Raises:
      ValueError on bad input before compiling; PoolExhaustedError if the pool runs out.
    """
    backend = resolve_backend(backend)
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    sampler, key = sampling_key(sampler, key)
    checked_stop_tokens(model, stop_tokens)
    policy_key, key = jax.random.split(key)
    start = time.perf_counter()
    with counting_compiles() as compiled:
        session = prefill_session(
            model,
            prompt_ids,
            policy,
            reserve_tokens=max_new_tokens - 1,  # the last sampled token is never written
            positions_after_prompt=max_new_tokens,
            cache=cache,
            prefill_chunk=prefill_chunk,
            key=policy_key,
            backend=backend,
            policy_params=policy_params,
            mesh=mesh,
            on_prefill_chunk=on_prefill_chunk,
        )
        jax.block_until_ready(session.last_hidden)
    prefilled = time.perf_counter()
    out = run_decode(
        session,
        max_new_tokens,
        sampler=sampler,
        key=key,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        consume=True,
        on_token=on_token,
    )
    return dataclasses.replace(
        out, prefill_seconds=prefilled - start, prefill_compile_seconds=compiled.seconds
    )


def generate_text(
    model: Model,
    tokenizer: Tokenizer,
    prompts: str | Sequence[str] | Sequence[dict],
    *,
    max_new_tokens: int,
    chat: bool = False,
    system: str | None = None,
    **options,
) -> list[str]:
    """Text in, text out: `generate` over `prompts` (one text, a list of texts, or with `chat`
    one conversation's messages [{"role", "content"}] / each text as a user message, after an
    optional `system` message, in the model's chat template) and each row's reply decoded up to
    its stop token (default stop tokens: the tokenizer's end token and the model's eos ids).
    `options`: any other argument of `generate`."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts must be non-empty text (or chat messages)")
    if system is not None and not chat:
        raise ValueError("system= is a chat message: give chat=True")
    if chat:
        head = [] if system is None else [{"role": "system", "content": system}]
        rows = [
            encode_chat(
                tokenizer, head + (p if isinstance(p, list) else [{"role": "user", "content": p}])
            )
            for p in prompts
        ]
    elif any(not isinstance(p, str) for p in prompts):
        raise ValueError("chat messages need chat=True")
    else:
        rows = [tokenizer.encode(p) for p in prompts]
    options.setdefault("stop_tokens", stop_tokens(tokenizer, model.config))
    options.setdefault("pad_id", tokenizer.pad_id)
    out = generate(model, rows, max_new_tokens=max_new_tokens, **options)
    stops = set(options["stop_tokens"])
    return [
        tokenizer.decode([t for t in row[: int(n)] if t not in stops])
        for row, n in zip(out.tokens, out.num_tokens, strict=True)
    ]


def compress_prompt(
    model: Model,
    prompt_ids: PromptIds,
    policy: Policy | str | None = None,
    *,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    key: jax.Array | None = None,
    backend: str | Backend = "auto",
    reserve_tokens: int = 0,
    policy_params: PolicyParams | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> KVState:
    """Prefills the prompts and applies the policy's compression; returns the KV state.

    `key` seeds stochastic policies (GVote); the same key gives the same result.
    `reserve_tokens`: room in every page table for that many tokens after the prompt, so the
    caller can go on writing to the returned state (questions, continuations).
    `cache`, `policy_params`, `prefill_chunk`, `backend`, `mesh`: as for `generate` (on a mesh the
    result is every device's state, stacked [S, ...]).
    """
    session = prefill(
        model,
        prompt_ids,
        policy,
        cache=cache,
        prefill_chunk=prefill_chunk,
        key=key,
        backend=backend,
        reserve_tokens=reserve_tokens,
        policy_params=policy_params,
        mesh=mesh,
    )
    return session.kv


@dataclasses.dataclass(frozen=True)
class AskOutput:
    """Answers to several questions over one compressed context (`ask`; host values).

    Attributes:
      answers: the rows' `GenerateOutput` (row i answers question i); its prefill times are
        the context's prefill (when `ask` was given its ids) and the questions' reading.
      shared_bytes: bytes of the context's pages all rows share, held once.
      row_bytes: int64 [N] bytes each row holds alone: its copy of the context's partial last
        pages, its question and its answer (and its local ring, for ring policies; with int8
        storage its copy of the context's window and its channel scales).
      total_bytes: bytes held after decoding: shared_bytes + row_bytes.sum().
      separate_bytes: bytes N copies of the context would hold, one per question:
        N x shared_bytes + row_bytes.sum().
    """

    answers: GenerateOutput
    shared_bytes: int
    row_bytes: np.ndarray
    total_bytes: int
    separate_bytes: int


def _same_model(a: Model, b: Model) -> bool:
    """Whether two models are the same configuration with the same parameter arrays."""
    if a.config != b.config:
        return False
    leaves_a, leaves_b = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    return len(leaves_a) == len(leaves_b) and all(
        x is y or (x.shape == y.shape and bool(jnp.array_equal(x, y)))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def ask(
    model: Model,
    context: PromptIds | Session,
    questions: Sequence[Sequence[int]],
    policy: Policy | str | None = None,
    *,
    max_new_tokens: int,
    sampler: Sampler | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    backend: str | Backend = "auto",
    policy_params: PolicyParams | None = None,
    on_prefill_chunk: Callable[[int, int], None] | None = None,
) -> AskOutput:
    """Answers each question over one compressed copy of `context`: the context is prefilled
    and compressed once (or given as a one-row `Session`), forked into one row per question
    (`Session.fork`: the rows share its pages) and decoded together. Each answer equals the
    question asked alone over the same compressed context (`decode(session.extend(q))`).

    context: one prompt's token ids, or a `Session` prefilled with `model` (then `policy`,
    `cache`, `policy_params` and `backend` are the session's). Other arguments as `generate`.
    """
    if not isinstance(questions, Sequence) or isinstance(questions, str) or not questions:
        raise ValueError("questions must be a non-empty list of token-id lists")
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    sampler, key = sampling_key(sampler, key)
    checked_stop_tokens(model, stop_tokens)
    policy_key, key = jax.random.split(key)
    start = time.perf_counter()
    if isinstance(context, Session):
        if not _same_model(context.model, model):
            raise ValueError(
                "context is a session prefilled with another model (its config or parameters "
                "differ): prefill the context with this model"
            )
        session = context
        check_shared_decode(session.policy, max_new_tokens)
    else:
        policy = resolved_policy(policy)
        check_shared_decode(policy, max_new_tokens)  # before the context's prefill
    with counting_compiles() as compiled:
        if not isinstance(context, Session):
            session = prefill(
                model,
                context,
                policy,
                cache=cache,
                prefill_chunk=prefill_chunk,
                key=policy_key,
                backend=backend,
                policy_params=policy_params,
                on_prefill_chunk=on_prefill_chunk,
            )
        rows = session.fork(
            questions, reserve_tokens=max_new_tokens - 1, prefill_chunk=prefill_chunk
        )
        jax.block_until_ready(rows.last_hidden)
    prefilled = time.perf_counter()
    answers = run_decode(
        rows,
        max_new_tokens,
        sampler=sampler,
        key=key,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        consume=True,
    )
    # Its prefill: the context's (when given ids), its fork and the questions' reading.
    answers = dataclasses.replace(
        answers, prefill_seconds=prefilled - start, prefill_compile_seconds=compiled.seconds
    )
    shared_bytes, own_bytes = shared_and_own_bytes(answers.state)
    row_bytes = own_bytes + answers.state.ring_bytes // len(questions)
    return AskOutput(
        answers=answers,
        shared_bytes=shared_bytes,
        row_bytes=row_bytes,
        total_bytes=shared_bytes + int(row_bytes.sum()),
        separate_bytes=len(questions) * shared_bytes + int(row_bytes.sum()),
    )
