"""The public decode step (`jaxkv.generation.decode_step`) is the generation loop's step, and
programs name each argument's mesh placement (`jaxkv.generation.mesh.program`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.generation import StepContext, decode_step
from jaxkv.generation.mesh import MODEL, ROWS, SHARD, program
from jaxkv.models import init_model
from tests.tiny_models import tiny_config

CONFIG = tiny_config(max_position_embeddings=512)
STEPS = 24


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.5)  # peaked next-token distributions


@functools.partial(jax.jit, static_argnames="policy")
def _teacher_forced(model, kv, tokens, starts, budget_tokens, budget_ratio, policy):
    """Reads tokens [B, N] with `decode_step`: (argmax of each step's logits [B, N], kv)."""
    context = StepContext(
        prompt_lengths=starts,
        budget_tokens=budget_tokens,
        budget_ratio=budget_ratio,
        key=jax.random.PRNGKey(0),
        step=jnp.zeros((), jnp.int32),
        policy=policy,
    )

    def step(kv, xs):
        token, i = xs
        kv, logits = decode_step(model, kv, token, starts + i, context.replace(step=i + 1))
        return kv, jnp.argmax(logits, axis=-1)

    kv, predicted = jax.lax.scan(step, kv, (tokens.T, jnp.arange(tokens.shape[1])))
    return predicted.T, kv


@pytest.mark.parametrize(
    "policy",
    [
        policies.FullCache(),
        policies.H2O(budget=40, recent=8),  # evicts during decode, every step
        policies.StreamingLLM(budget=32),
    ],
    ids=lambda p: p.name,
)
def test_decode_step_reproduces_generate_token_for_token(model, policy):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 64, n).tolist() for n in (70, 45)]
    out = jaxkv.generate(model, prompts, max_new_tokens=STEPS, policy=policy, stop_tokens=())
    kv = jaxkv.compress_prompt(model, prompts, policy, reserve_tokens=STEPS)
    starts = np.array([len(p) for p in prompts], np.int32)
    predicted, kv = _teacher_forced(
        model,
        kv,
        jnp.asarray(out.tokens[:, :-1]),
        starts,
        policy.budget_tokens(starts),
        policy.budget_ratio(len(prompts)),
        policy=policy.static(),
    )
    np.testing.assert_array_equal(np.asarray(predicted), out.tokens[:, 1:])
    # The same tokens held per head as the loop's final state (evicting policies included).
    np.testing.assert_array_equal(np.asarray(kv.lengths), np.asarray(out.state.lengths))


def test_a_program_places_every_argument_by_name():
    def step(model, kv, lengths, *, chunk):
        return kv

    with pytest.raises(TypeError, match=r"give each of \['model', 'kv', 'lengths', 'chunk'\]"):
        program(static=("chunk",), model=MODEL, kv=SHARD)(step)
    with pytest.raises(TypeError, match="donated 'lengths' must be placed SHARD"):
        program(static=("chunk",), donate=("lengths",), model=MODEL, kv=SHARD, lengths=ROWS)(step)
    placed = program(static=("chunk",), model=MODEL, kv=SHARD, lengths=ROWS)(step)
    assert list(placed.placements) == ["model", "kv", "lengths"]
    with pytest.raises(TypeError, match=r"missing \['lengths'\], unexpected \['length'\]"):
        placed(None, model=None, kv=jnp.zeros(2), length=jnp.zeros(2), chunk=4)
    np.testing.assert_array_equal(
        placed(None, model=None, kv=jnp.ones(2), lengths=jnp.zeros(2), chunk=4), np.ones(2)
    )
