"""The tiny random model shapes most tests share (GQA 2, head dim 16), per family."""

from jaxkv.models import ModelConfig
from jaxkv.models.configs import Family


def tiny_config(family: Family = Family.QWEN3, **overrides) -> ModelConfig:
    """2 layers, width 64, 4 query / 2 KV heads of 16; the family's own flags (Qwen3 q/k norm,
    Qwen2 qkv bias); `overrides` replace any field."""
    fields = dict(
        family=family,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=family is Family.QWEN3,
        qkv_bias=family is Family.QWEN2,
        max_position_embeddings=1024,
    )
    return ModelConfig(**(fields | overrides))
