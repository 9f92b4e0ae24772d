"""Config conversion from/to Hugging Face dictionaries, in both the v4 and v5 RoPE forms."""

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxkv.models import from_hf_config, preset, to_hf_config
from jaxkv.models.configs import Family, RopeScaling
from jaxkv.models.layers import rope_inv_freq
from tests import hf_models


@pytest.mark.parametrize("case", sorted(hf_models.CASES))
def test_round_trip_through_hf_dict(case):
    config_cls, kwargs = hf_models.CASES[case]
    cfg = from_hf_config(config_cls(**kwargs).to_dict())
    assert from_hf_config(to_hf_config(cfg)) == cfg
    # What we write is what transformers reads back.
    reread = from_hf_config(config_cls(**to_hf_config(cfg)).to_dict())
    assert reread == cfg


def test_llama3_inv_freq_matches_transformers():
    config_cls, kwargs = hf_models.CASES["llama3-rope-scaling-untied"]
    hf_config = config_cls(**kwargs)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    got = rope_inv_freq(from_hf_config(hf_config.to_dict()))
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-6)


def test_legacy_v4_rope_fields():
    legacy = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_theta=123.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    cfg = from_hf_config(legacy)
    assert cfg.rope_theta == 123.0
    assert cfg.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4 and cfg.family is Family.LLAMA


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"model_type": "mistral"}, KeyError, "model_type='mistral'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ValueError, "rope_type='yarn'"),
        (
            {"num_key_value_heads": 4},
            ValueError,
            "num_heads=6 must be a multiple of num_kv_heads=4",
        ),
        ({"hidden_act": "gelu"}, ValueError, "hidden_act='gelu'"),
        ({"use_sliding_window": True}, ValueError, "use_sliding_window"),
    ],
)
def test_unsupported_configs_are_rejected(change, error, match):
    base = dict(
        model_type="qwen2",
        vocab_size=10,
        hidden_size=24,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    with pytest.raises(error, match=match):
        from_hf_config(base | change)


def test_presets():
    assert preset("tiny-random").group_size == 2
    with pytest.raises(KeyError, match="preset='nope'"):
        preset("nope")
    assert transformers.Qwen3Config(**to_hf_config(preset("tiny-random"))).head_dim == 32
