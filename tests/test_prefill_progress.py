"""`on_prefill_chunk`: progress over a long prompt's prefill, one program call per chunk, with the
tokens and the cache of the one-program prefill."""

import numpy as np
import pytest

import jaxkv
from jaxkv import cli, policies
from jaxkv.models import init_model
from tests.test_sharding import CONFIG, POLICY_PARAMS

CHUNK = 16


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.3)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, CONFIG.vocab_size, size=n).tolist() for n in (70, 45)]


def _kept(state) -> np.ndarray:
    return np.sort(np.asarray(state.positions()), axis=-1)


@pytest.mark.parametrize(
    "spec", ["full", "snapkv:0.5:window=8", "h2o:0.5:evict_every=2", "fastkvzip:0.5"]
)
def test_progress_is_reported_per_chunk_and_changes_nothing(model, spec):
    policy = policies.from_spec(spec)
    params = POLICY_PARAMS[policy.name]() if policy.name in POLICY_PARAMS else None

    def generate(**progress):
        return jaxkv.generate(
            model,
            _prompts(),
            max_new_tokens=6,
            policy=policy,
            policy_params=params,
            prefill_chunk=CHUNK,
            stop_tokens=(),
            **progress,
        )

    reported = []
    with_progress = generate(on_prefill_chunk=lambda done, total: reported.append((done, total)))
    chunks = -(-70 // CHUNK)
    assert reported == [(done, chunks) for done in range(1, chunks + 1)]
    plain = generate()
    np.testing.assert_array_equal(with_progress.tokens, plain.tokens)
    np.testing.assert_array_equal(_kept(with_progress.state), _kept(plain.state))
    np.testing.assert_array_equal(with_progress.memory_bytes, plain.memory_bytes)


def test_ask_reports_the_context_s_prefill(model):
    reported = []
    jaxkv.ask(
        model,
        _prompts()[0],
        [[5, 6, 7]],
        "snapkv:0.5:window=8",
        max_new_tokens=2,
        prefill_chunk=CHUNK,
        on_prefill_chunk=lambda done, total: reported.append(done),
    )
    assert reported == [1, 2, 3, 4, 5]


def test_the_cli_bar_counts_the_chunks_and_closes_after_the_last(monkeypatch):
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True)
    progress = cli.PrefillProgress(policies.get("snapkv", budget=0.5))
    for done in (1, 2, 3):
        progress(done, 3)
    assert (progress.bar.n, progress.bar.total) == (3, 3)
    assert progress.bar.disable  # closed
