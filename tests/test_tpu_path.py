"""The TPU path: every program that `generate` runs, for every registered policy, lowers for
"tpu" with backend "pallas" (Mosaic calls, no Triton call), and `generate` in the TPU
interpreters (backend "interpret-tpu": the Mosaic paged decode kernel and jax's splash
attention) gives the tokens of backend "xla" for the policies whose programs differ most.

The prompt is longer than 128 tokens, so the prefill's causal attention goes through splash
attention (`pallas_kernels/splash.py`), whose kernel is built once and cached: the policies that
score the prompt run it inside the layer scan, where a kernel first built inside a trace used to
leak that trace's arrays into the next one (an `UnexpectedTracerError` for every scored prefill
after the first program that built the kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.attention.dispatch import Backend
from jaxkv.generation import mesh as programs
from jaxkv.models import init_model
from tests.test_lowering import MOSAIC_CALL, TRITON_CALL
from tests.test_sharding import CONFIG, POLICIES, POLICY_PARAMS

PROMPT_TOKENS = 150  # over splash's 128-token tile: the prefill attends through it
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1, scale=0.3)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(3).integers(0, CONFIG.vocab_size, PROMPT_TOKENS).tolist()


@pytest.fixture
def lowered_for_tpu(monkeypatch):
    """Runs each program as it is, and lowers the same program for "tpu" with backend
    "pallas" where it runs with a backend: {program name: lowered StableHLO text}."""
    texts: dict[str, str] = {}
    run = programs.Program._run

    def run_and_lower(self, mesh, arguments):
        if arguments.get("backend") in (Backend.XLA, Backend.INTERPRET_TPU):
            on_tpu = arguments | {"backend": Backend.PALLAS}
            lowered = self.jitted.trace(**on_tpu).lower(lowering_platforms=("tpu",))
            texts[self.fn.__name__] = lowered.as_text()
        return run(self, mesh, arguments)

    monkeypatch.setattr(programs.Program, "_run", run_and_lower)
    return texts


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


@pytest.mark.parametrize("name", policies.registered())
def test_every_program_of_every_policy_lowers_for_tpu(model, prompt, lowered_for_tpu, name):
    """Each program `generate` runs, traced again for "tpu" with backend "pallas": Mosaic calls,
    never a Triton call."""
    _generate(model, prompt, name, "xla")
    assert any("decode_loop" in program for program in lowered_for_tpu), sorted(lowered_for_tpu)
    assert any("prefill" in program for program in lowered_for_tpu), sorted(lowered_for_tpu)
    for program, text in lowered_for_tpu.items():
        assert TRITON_CALL not in text, program
        assert MOSAIC_CALL in text, program


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
