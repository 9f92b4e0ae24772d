"""The decode driver of sessions: `decode(session, ...)` runs the decode loop over a prefilled
context (`jaxkv.generation.session`) and returns a `GenerateOutput` (host arrays), the session
left as it was; `generate` runs it consuming its own session's state."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.cache import KVState
from jaxkv.cache.config import check_count
from jaxkv.cache.geometry import decode_steps_bucket
from jaxkv.compile_log import counting_compiles
from jaxkv.generation.loop import (
    GenState,
    decode_loop,
    decode_loop_keeping_kv,
    to_decode_geometry,
    token_listener,
)
from jaxkv.generation.request import checked_key, checked_stop_tokens
from jaxkv.generation.session import Session, check_positions
from jaxkv.policies import Policy
from jaxkv.sampling import Sampler
from jaxkv.sharding import InferenceMesh


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Result of `generate` and `decode` (host arrays).

    Attributes:
      tokens: int32 [B, max_new_tokens]; positions after a sequence's stop token hold pad_id.
      num_tokens: int32 [B] tokens generated per sequence (the stop token included).
      pages_in_use: int32 [steps] pages held after prefill and after each decode step (of the
        model-dtype pool).
      int8_pages_in_use: int32 [steps] the same of the int8 tier (0 without int8 storage).
      memory_bytes: int64 [steps] the bytes all those pages hold (and the int8 channel scales,
        and the local ring of ring policies).
      policy_trace: f32 [steps, B] what the policy recorded of the logits each token was
        sampled from (its decode eviction's `step_record`; Conf-KV: its confidence, with its
        weights); None for policies that record nothing.
      state: the final KV state; on a mesh, every device's state stacked on a leading axis
        [S] (`jaxkv.sharding`: shard s holds data shard s // model, model shard s % model).
      compressed: bool [B] whether the policy had dropped any token each row had read when
        the decode began (`generate`: its prompt); False for a row kept whole, e.g. a prompt
        shorter than what the policy compresses (`Session.compressed`).
      decode_seconds: wall time of the decode (its compilation included on a first call).
      decode_compile_seconds: the part of `decode_seconds` spent compiling (0 when every
        program was compiled before).
      prefill_seconds: wall time of the prefill and compression (`generate`; None for
        `decode`, whose session was prefilled before), compilation included.
      prefill_compile_seconds: the part of `prefill_seconds` spent compiling (None with it).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    pages_in_use: np.ndarray
    int8_pages_in_use: np.ndarray
    memory_bytes: np.ndarray
    policy_trace: np.ndarray | None
    state: KVState
    compressed: np.ndarray
    decode_seconds: float = 0.0
    decode_compile_seconds: float = 0.0
    prefill_seconds: float | None = None
    prefill_compile_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        """Tokens generated (all rows) per second of decode, its compilation left out."""
        running = self.decode_seconds - self.decode_compile_seconds
        return float(np.sum(self.num_tokens)) / max(running, 1e-9)


def _check_shared_decode(session: Session, max_new_tokens: int) -> None:
    """A forked session decodes only where no eviction runs: it would free shared pages."""
    if session.shared:
        check_shared_decode(session.policy, max_new_tokens)


class SharedDecodeError(ValueError):
    """`max_new_tokens` too many for rows that share pages under a policy that evicts while
    decoding (`check_shared_decode`)."""


def check_shared_decode(policy: Policy, max_new_tokens: int) -> None:
    """SharedDecodeError unless `policy` decodes `max_new_tokens` tokens of rows that share
    pages (a forked session, `ask`) without evicting: eviction would free pages the rows
    share."""
    eviction = policy.decode_eviction
    if eviction is None or max_new_tokens <= eviction.decode_interval:
        return
    raise SharedDecodeError(
        f"policy {policy.name!r} evicts during decode every "
        f"{eviction.decode_interval} step(s), which would free pages its rows share: decode "
        f"a forked session with max_new_tokens <= {eviction.decode_interval}, or with a "
        "policy that compresses the prompt only (e.g. 'kvzip:0.3', 'snapkv:0.3')"
    )


def decode(
    session: Session,
    max_new_tokens: int,
    *,
    sampler: Sampler | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    on_token: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens per row after what the session has read, the
    policy's decode eviction applied as in `generate`. `session` stays valid: decoding it again
    (another sampler, key or length) starts from the same state.

    sampler: default greedy; a PRNG `key` is required when it is not greedy. stop_tokens: ids
    that end a row (default: the model's eos ids). on_token: `on_token(step, tokens int32 [B],
    done bool [B])`, called in order as each step's tokens are sampled (from inside the jitted
    loop, through `jax.debug.callback`); one device only.
    """
    return run_decode(
        session,
        max_new_tokens,
        sampler=sampler,
        key=key,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        consume=False,
        on_token=on_token,
    )


def sampling_key(sampler: Sampler | None, key) -> tuple[Sampler, jax.Array]:
    """(sampler, key): greedy by default; a key is required when sampling."""
    sampler = Sampler() if sampler is None else sampler
    if key is None:
        if not sampler.greedy:
            raise ValueError("a PRNG key is required when sampling (temperature > 0)")
        key = jax.random.PRNGKey(0)
    return sampler, checked_key(key)


def run_decode(
    session: Session,
    max_new_tokens: int,
    *,
    sampler: Sampler | None,
    key,
    stop_tokens,
    pad_id: int,
    consume: bool,
    on_token=None,
) -> GenerateOutput:
    """`decode`; `consume`: the session's state is used up (`generate`): donated to the loop,
    or freed once repacked into the decode geometry."""
    if not isinstance(session, Session):
        raise ValueError(f"session={session!r}: give a jaxkv Session (jaxkv.prefill)")
    if on_token is not None and session.placement is not None:
        raise ValueError("on_token streams from one device: decode without a mesh")
    start = time.perf_counter()
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    sampler, key = sampling_key(sampler, key)
    stop_tokens = checked_stop_tokens(session.model, stop_tokens)
    check_positions(session, max_new_tokens, "new tokens")
    _check_shared_decode(session, max_new_tokens)
    policy, placement = session.policy, session.placement
    compressed = session.compressed()  # before the loop, which may consume the state
    kv = to_decode_geometry(
        session.kv,
        policy,
        budget_tokens=session.budget_tokens,
        lengths=session.lengths,
        placement=placement,
        num_pages=session.cache.num_pages if not session.shared else None,
        max_new_tokens=max_new_tokens,
        shared=session.shared,
    )
    rows = session.rows(sampler, key)
    loop = decode_loop if consume else decode_loop_keeping_kv
    if consume:
        free_buffers_left_behind(session.kv, kv)
    with token_listener(on_token) as listener, counting_compiles() as compiled:
        state = loop(
            placement,
            model=session.model,
            kv=kv,
            last_hidden=session.last_hidden,
            rows=rows,
            max_new_tokens=np.int32(max_new_tokens),
            stop_tokens=jnp.asarray(stop_tokens, jnp.int32).reshape(-1),
            policy_params=session.policy_params,
            steps_bucket=decode_steps_bucket(max_new_tokens),
            policy=policy.static(),
            pad_id=pad_id,
            backend=session.backend,
            listener=listener,
        )
        out = _output(state, max_new_tokens, stop_tokens, placement, compressed)
    return dataclasses.replace(
        out, decode_seconds=time.perf_counter() - start, decode_compile_seconds=compiled.seconds
    )


def free_buffers_left_behind(prefill_kv: KVState, decode_kv: KVState) -> None:
    """Frees the arrays of `prefill_kv` that `decode_kv` does not hold: after a repack into the
    decode geometry nothing reads the prefill pool again, and the caller's session would keep it
    alive beside the decode pool through the whole decode loop."""
    held = {id(leaf) for leaf in jax.tree.leaves(decode_kv)}
    for leaf in jax.tree.leaves(prefill_kv):
        if isinstance(leaf, jax.Array) and id(leaf) not in held:
            leaf.delete()


def _output(
    state: GenState,
    max_new_tokens: int,
    stop_tokens,
    placement: InferenceMesh | None,
    compressed: np.ndarray,
) -> GenerateOutput:
    """The host-side result of the decode loop (a mesh's rows joined, its pages summed)."""
    state.kv.check()
    if placement is None:
        per_row, summed = np.asarray, np.asarray
    else:
        per_row, summed = placement.join_rows, placement.sum_shards
    steps = int(np.max(sharding.to_host(state.step)))
    tokens = per_row(state.tokens)[:, :max_new_tokens]
    is_stop = np.isin(tokens, np.asarray(stop_tokens, np.int32))
    num_tokens = np.where(is_stop.any(axis=1), is_stop.argmax(axis=1) + 1, steps)
    pages = summed(state.pages_in_use)[:steps]
    int8_pages = summed(state.int8_pages_in_use)[:steps]
    memory_bytes = pages.astype(np.int64) * state.kv.pool.page_bytes + state.kv.ring_bytes
    if state.kv.pool.int8 is not None:
        tier = state.kv.pool.int8
        memory_bytes += int8_pages.astype(np.int64) * tier.pool.page_bytes
        memory_bytes += tier.channel_scale_bytes
    policy_trace = None
    if state.policy_trace is not None:
        policy_trace = per_row(jnp.swapaxes(state.policy_trace, -1, -2)).T[:steps]
    return GenerateOutput(
        tokens=tokens,
        num_tokens=num_tokens.astype(np.int32),
        pages_in_use=pages,
        int8_pages_in_use=int8_pages,
        memory_bytes=memory_bytes,
        policy_trace=policy_trace,
        state=state.kv,
        compressed=compressed,
    )
