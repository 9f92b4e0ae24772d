"""A prefill chunk longer than `MAX_FORWARD_TOKENS` runs its forward in pieces: what prefill
records (observed queries, attention-input moments, the last hidden state) and what the policy
keeps are those of the whole chunk."""

import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.generation import prefill
from jaxkv.models import init_model
from tests.tiny_models import tiny_config

CHUNK = 128


@pytest.mark.parametrize(
    ("chunk", "bound", "piece"),
    [
        (512, 2048, 512),
        (2048, 2048, 2048),
        (16384, 2048, 2048),
        (3000, 2048, 1500),
        (4099, 2048, 4099),
        (128, 32, 32),
        (96, 64, 48),
    ],
)
def test_pieces_tile_the_chunk_within_the_bound(monkeypatch, chunk, bound, piece):
    monkeypatch.setattr(prefill, "MAX_FORWARD_TOKENS", bound)
    assert prefill.forward_piece(chunk) == piece
    assert chunk % piece == 0


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config(), seed=3, scale=0.3)


def retrace_prefill():
    """The piece bound is read while tracing: the prefill programs are traced again. Only their
    caches are dropped: with `jax.clear_caches()` the first such test took 141-163 s in a suite
    worker that had compiled many programs before, against 15 s alone."""
    prefill.prefill_and_compress.jitted.clear_cache()
    prefill.prefill_span.jitted.clear_cache()


def _run(model, policy, piece_bound):
    retrace_prefill()
    pieces, forward_piece = [], prefill.forward_piece
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefill, "MAX_FORWARD_TOKENS", piece_bound)
        patch.setattr(
            prefill, "forward_piece", lambda c: pieces.append(forward_piece(c)) or pieces[-1]
        )
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (300, 171)]
        out = jaxkv.generate(
            model, prompts, max_new_tokens=4, policy=policy, prefill_chunk=CHUNK, stop_tokens=[]
        )
    retrace_prefill()
    assert pieces and set(pieces) == {piece_bound}  # traced with this bound
    return out


@pytest.mark.parametrize(
    "policy",
    [
        policies.get("snapkv", budget=0.3, window=16),  # observed queries
        policies.get("gvote"),  # attention-input moments
        policies.get("h2o", budget=0.3),  # attention mass over the chunk
    ],
    ids=["snapkv", "gvote", "h2o"],
)
def test_pieces_keep_and_generate_as_the_whole_chunk(model, policy):
    whole = _run(model, policy, CHUNK)
    pieces = _run(model, policy, CHUNK // 4)
    np.testing.assert_array_equal(pieces.tokens, whole.tokens)
    np.testing.assert_array_equal(
        np.sort(np.asarray(pieces.state.positions()), axis=-1),
        np.sort(np.asarray(whole.state.positions()), axis=-1),
    )
