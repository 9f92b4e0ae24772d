"""Policies with learned parameters: per-layer params reach `write_scores`, scores are stored
with the tokens and drive admission; mismatched params are refused before compiling."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.models import init_model
from jaxkv.models.decoder import attention_input, embed, project_unrotated_keys_values
from tests.tiny_models import tiny_config

CONFIG = tiny_config()


@dataclasses.dataclass(frozen=True)
class _LinearKeyScores:
    """The gate part: score = w[layer, head] . k_unrotated."""

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del h, k, positions, q, v
        return jnp.einsum("bkch,kh->bkc", k_unrotated.astype(jnp.float32), layer_params)


@dataclasses.dataclass(frozen=True)
class _PositiveScores:
    """The admission part: tokens scoring > 0, no ring (admission decides the write itself)."""

    local_window: ClassVar[int] = 0

    def admit(self, *, layer, k, v, positions, scores, thresholds):
        del layer, k, v, positions, thresholds
        return scores > 0

    def prefill_pages(self, prompt_lengths, chunk, config, page_size, reserve) -> int:
        """A first guess of one page per head (the pool grows as admission fills it)."""
        del chunk, reserve
        return config.num_layers * config.num_kv_heads * len(prompt_lengths)


@dataclasses.dataclass(frozen=True)
class LinearKeyGate(policies.Policy):
    """Score = w[layer, head] . k_unrotated; admit tokens scoring > 0 (a test-only policy)."""

    name: ClassVar[str] = "test_linear_key_gate"

    def _parts(self):
        return {"gate": _LinearKeyScores(), "admission": _PositiveScores()}

    def check_params(self, params, model_config) -> None:
        expected = (model_config.num_layers, model_config.num_kv_heads, model_config.head_dim)
        if params is None or params.shape != expected:
            shape = None if params is None else params.shape
            raise ValueError(f"policy_params has shape {shape}: expected {expected}")


def first_layer_scores(model, tokens, w):
    """The gate's scores for layer 0, computed directly from the model's projections."""
    lp = jax.tree.map(lambda x: x[0], model.params["layers"])
    h = attention_input(lp, CONFIG, embed(model.params, jnp.asarray(tokens)[None]))
    k_unrotated, _ = project_unrotated_keys_values(lp, CONFIG, h)
    return np.asarray(jnp.einsum("bkch,kh->bkc", k_unrotated, w[0]))[0]


def test_scores_stored_and_admission_follows_them():
    model = init_model(CONFIG, seed=3, scale=0.3)
    w = jax.random.normal(jax.random.PRNGKey(1), (2, 2, 16))
    tokens = np.random.default_rng(0).integers(0, 64, 100).tolist()
    state = jaxkv.compress_prompt(
        model, [tokens], LinearKeyGate(), policy_params=w, prefill_chunk=32
    )
    expected = first_layer_scores(model, tokens, w)  # [K, T]
    positions = np.asarray(state.positions(0))[0]
    scores = np.asarray(state.token_scores(0))[0]
    for head in range(CONFIG.num_kv_heads):
        admitted = np.flatnonzero(expected[head] > 0)
        held = positions[head][positions[head] >= 0]
        np.testing.assert_array_equal(held, admitted)
        np.testing.assert_allclose(scores[head, : len(held)], expected[head, held], rtol=1e-5)
    assert 0 < int(np.asarray(state.lengths[0]).sum()) < 2 * len(tokens)


def test_params_are_checked_before_compiling():
    model = init_model(CONFIG, seed=3)
    with pytest.raises(ValueError, match="policy_params has shape"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=LinearKeyGate())
    with pytest.raises(ValueError, match="takes no policy_params"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, policy_params=jnp.zeros(3))
