"""The bundled reference model: its recipe's architecture, and transformers reads the same model."""

import numpy as np
import torch
import transformers

from jaxkv.benchmarks.quality import REFERENCE_MODEL
from jaxkv.models import forward, load_hf_checkpoint
from jaxkv.train.pretrain import RECIPES


def test_reference_model_is_the_recipe_and_small():
    model = load_hf_checkpoint(REFERENCE_MODEL, dtype="float32")
    assert model.config == RECIPES["reference"].model
    assert (REFERENCE_MODEL / "model.safetensors").stat().st_size < 20 * 2**20
    assert (REFERENCE_MODEL / "training.json").exists()


def test_transformers_computes_the_same_logits():
    ours = load_hf_checkpoint(REFERENCE_MODEL, dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        REFERENCE_MODEL, dtype=torch.float32, attn_implementation="eager"
    )
    text = b"def retrieve(cache, key):\n    # The special magic number for amber-otter is "
    tokens = np.array([[256, *text]], np.int32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(ours, tokens)), expected, atol=2e-4, rtol=0)
