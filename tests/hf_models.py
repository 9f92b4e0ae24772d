"""Tiny random Hugging Face models built from configs in code (no downloads), for parity tests."""

from __future__ import annotations

import torch
import transformers

from jaxkv.models import load_hf_checkpoint

# Each case: (name, transformers config class, config kwargs). All GQA (4 query heads, 2 KV heads).
_COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

CASES = {
    "llama3-rope-scaling-untied": (
        transformers.LlamaConfig,
        dict(
            _COMMON,
            head_dim=16,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama2-tied": (
        transformers.LlamaConfig,
        dict(_COMMON, rope_theta=10000.0, tie_word_embeddings=True),
    ),
    "qwen2-bias-tied": (
        transformers.Qwen2Config,
        dict(_COMMON, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    "qwen3-qknorm-untied": (
        transformers.Qwen3Config,
        dict(_COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False),
    ),
}


def build(case: str, seed: int = 0, scale: float = 0.08) -> transformers.PreTrainedModel:
    """A random fp32 causal LM for `case`, with non-trivial norms and biases.

    `scale` is the weights' standard deviation; larger values give peakier attention.
    """
    config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**kwargs), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(scale * torch.randn_like(param))
    return model.eval()


def build_and_load(case: str, directory, seed: int = 0, scale: float = 0.08):
    """`build(case)` saved to `directory` in Hugging Face format and loaded back as the
    project's f32 model: (transformers model, jaxkv model)."""
    hf = build(case, seed, scale)
    hf.save_pretrained(directory)
    return hf, load_hf_checkpoint(directory, dtype="float32")
