"""The TPU path in the TPU interpreters: `generate` with backend "interpret-tpu" (the Mosaic
paged decode kernel and jax's splash attention) gives the tokens of backend "xla" for the
policies whose programs differ most. The prompt is longer than 128 tokens, so the prefill's
causal attention goes through splash attention (`pallas_kernels/splash.py`). That every program
of every policy lowers for "tpu" is checked on the CLI's run of each policy (`tests/test_cli.py`).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.models import init_model
from tests.test_sharding import CONFIG, POLICIES, POLICY_PARAMS

PROMPT_TOKENS = 150  # over splash's 128-token tile: the prefill attends through it
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(3).integers(0, CONFIG.vocab_size, PROMPT_TOKENS).tolist()


def _generate(model, prompt, name, backend):
    return jaxkv.generate(
        model,
        [prompt],
        max_new_tokens=NEW_TOKENS,
        policy=policies.get(name, **POLICIES[name]),
        policy_params=POLICY_PARAMS[name]() if name in POLICY_PARAMS else None,
        stop_tokens=[],
        backend=backend,
    )


# The interpreters are slow on a CPU: the policies whose programs differ most (the full cache;
# a scored prefill, the case that crashed; decode eviction; page selection; a learned gate with
# a local ring; a learned sink gate with chunk eviction).
INTERPRETED = ["full", "snapkv", "h2o", "quest", "wgkv", "fastkvzip"]


@pytest.mark.parametrize("name", INTERPRETED)
def test_the_tpu_interpreters_give_xla_s_tokens(model, prompt, name):
    want = _generate(model, prompt, name, "xla")
    got = _generate(model, prompt, name, "interpret-tpu")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.pages_in_use, want.pages_in_use)
