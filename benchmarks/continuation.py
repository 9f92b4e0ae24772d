"""Greedy answers over a compressed cache: read a chunk of new tokens over (and into) the state
`compress_prompt` left, then decode greedily with the full-cache rule (the policy's decode-time
hooks do not run). The quality benchmarks' question-agnostic settings answer this way: the byte
tasks' multiquestion and bits per byte, and the real-model needles' `agnostic` setting."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import policies
from jaxkv.forward import forward_cached
from jaxkv.models.decoder import logits_from_hidden

# Fills the rows of a chunk past their end, where position -1 marks them as padding (the
# byte-level model's pad id, used for every model).
PAD = 258


@functools.partial(jax.jit, static_argnames="policy")
def read_chunk(model, kv, tokens, positions, policy):
    """Logits f32 [B, C, V] of a chunk read over (and appended to) the state, and the state."""
    hidden, kv, _ = forward_cached(model, tokens, positions, kv, policy=policy)
    return logits_from_hidden(model.params, model.config, hidden), kv


def right_aligned(rows: list[list[int]], starts: np.ndarray):
    """Chunk tokens [B, C] and positions (-1 padding) of rows continuing at `starts`."""
    width = max(map(len, rows))
    tokens = np.full((len(rows), width), PAD, np.int32)
    positions = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
        positions[i, : len(row)] = starts[i] + np.arange(len(row))
    return jnp.asarray(tokens), jnp.asarray(positions)


def greedy_continuation(model, kv, question_rows, starts, steps: int) -> np.ndarray:
    """Reads the questions over `kv`, then greedy-decodes `steps` tokens: int [B, steps]."""
    full = policies.FullCache().static()
    tokens, positions = right_aligned(question_rows, starts)
    logits, kv = read_chunk(model, kv, tokens, positions, full)
    last = np.array([len(row) - 1 for row in question_rows])
    next_token = np.asarray(jnp.argmax(logits, -1))[np.arange(len(last)), last]
    position = starts + last + 1
    generated = [next_token]
    for _ in range(steps - 1):
        logits, kv = read_chunk(
            model, kv, jnp.asarray(next_token[:, None]), jnp.asarray(position[:, None]), full
        )
        next_token = np.asarray(jnp.argmax(logits[:, 0], -1))
        position = position + 1
        generated.append(next_token)
    return np.stack(generated, axis=1)
