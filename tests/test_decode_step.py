"""The public decode step (`jaxkv.generation.decode_step`) is the generation loop's step, and
programs name each argument's mesh placement (`jaxkv.generation.mesh.program`)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.cache import KVState
from jaxkv.generation import StepContext, decode_step
from jaxkv.generation.mesh import MODEL, ROWS, SHARD, program
from jaxkv.models import init_model
from jaxkv.step.forward import forward_cached
from jaxkv.step.parts import local_window
from tests.decode_steps import policy_rows
from tests.tiny_models import tiny_config

CONFIG = tiny_config(max_position_embeddings=512)
STEPS = 24


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.5)  # peaked next-token distributions


@functools.partial(jax.jit, static_argnames="policy")
def _teacher_forced(model, kv, tokens, rows, policy):
    """Reads tokens [B, N] with `decode_step`: (argmax of each step's logits [B, N], kv)."""
    everyone = jnp.ones(tokens.shape[:1], bool)
    rows = rows.advanced(everyone)  # as in `generate`: the first token was sampled

    def step(carry, token):
        kv, rows = carry
        kv, logits = decode_step(model, kv, token, everyone, StepContext(rows, policy=policy))
        return (kv, rows.advanced(everyone)), jnp.argmax(logits, axis=-1)

    (kv, _), predicted = jax.lax.scan(step, (kv, rows), tokens.T)
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
        model, kv, jnp.asarray(out.tokens[:, :-1]), policy_rows(policy, starts), policy.static()
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


POOL_PAGES = 37  # a pool shape no other array has


def _abstract_step(spec: str):
    """(model, abstract KV state of POOL_PAGES pages, step context) of a tiny model."""
    cfg = tiny_config(num_layers=2, num_kv_heads=2, head_dim=32)
    policy = policies.from_spec(spec)
    kv = jax.eval_shape(
        lambda: KVState.create(
            num_layers=2,
            batch=1,
            num_kv_heads=2,
            head_dim=32,
            max_tokens=512,
            page_size=16,
            num_pages=POOL_PAGES,
            dtype=jnp.float32,
            local_window=local_window(policy),
        )
    )
    context = StepContext(rows=policy_rows(policy, [400]), policy=policy.static())
    return init_model(cfg, seed=0), kv, context


def _pool_copies(hlo: str) -> list[str]:
    return re.findall(rf"f32\[{POOL_PAGES},16,32\]\S* copy\(", hlo)


@pytest.mark.parametrize(
    "spec",
    ["full", "h2o:0.25", "snapkv:0.25", "observed_attention:0.25", "local_attention:window=64"],
)
@pytest.mark.parametrize("chunk", [1, 32])
def test_xla_updates_the_pool_in_place_without_copying_it(spec, chunk):
    """A decode step and a prefill chunk write the pool in place: the compiled program holds
    no copy of a K or V pool (XLA copies it when a read of the pool must precede the write;
    attention-mass policies used to, every layer and step, and so did a ring's promotions after
    the attention, WG-KV's decode then slower than the full cache's)."""
    model, kv, context = _abstract_step(spec)
    rows = jnp.zeros((1, chunk), jnp.int32)

    def chunk_step(model, kv, tokens, positions, ctx):
        hidden, kv, _ = forward_cached(
            model,
            tokens,
            positions,
            kv,
            policy=ctx.policy,
            backend=ctx.backend,
            thresholds=ctx.rows.thresholds,
        )
        return kv, hidden

    hlo = (
        jax.jit(chunk_step, donate_argnums=1)
        .lower(model, kv, rows, rows, context)
        .compile()
        .as_text()
    )
    copies = _pool_copies(hlo)
    assert not copies, f"{len(copies)} copies of a pool"


@pytest.mark.parametrize(
    "spec", ["h2o:0.25", "streaming_llm:0.25", "sage_kv:0.25", "scissorhands:0.25", "confkv"]
)
def test_decode_eviction_compacts_the_pool_in_place(spec):
    """A decode step with its conditional eviction (due every few steps, then in place or a
    compaction) holds no copy of a pool: a `lax.cond` around the eviction made XLA copy the
    whole pool into the conditional (`run_if`)."""
    model, kv, context = _abstract_step(spec)
    tokens, active = jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)
    hlo = jax.jit(decode_step, donate_argnums=1).lower(model, kv, tokens, active, context)
    copies = _pool_copies(hlo.compile().as_text())
    assert not copies, f"{len(copies)} copies of a pool"
