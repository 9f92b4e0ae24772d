"""The project's models match tiny random `transformers` models after a save/load round trip."""

import numpy as np
import pytest
import torch

import jaxkv
from jaxkv.models import forward
from tests import hf_models


@pytest.fixture(scope="module", params=sorted(hf_models.CASES))
def hf_and_ours(request, tmp_path_factory):
    return hf_models.build_and_load(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(hf_and_ours):
    hf, ours = hf_and_ours
    tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 48))
    with torch.no_grad():
        expected = hf(torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(forward(ours, tokens))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(hf_and_ours):
    hf, ours = hf_and_ours
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in (7, 19)]
    out = jaxkv.generate(
        ours,
        prompts,
        max_new_tokens=32,
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=8),
        prefill_chunk=8,
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(
                torch.as_tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                min_new_tokens=32,
                pad_token_id=0,
            )
        np.testing.assert_array_equal(out.tokens[row], expected[0, len(prompt) :].numpy())
