"""Functional Llama / Qwen decoders, their configs, checkpoints and tokenizers."""

from jaxkv.models.configs import (
    Family,
    ModelConfig,
    RopeScaling,
    from_hf_config,
    preset,
    to_hf_config,
)
from jaxkv.models.decoder import Model, forward, init_model, init_params, scan_layers
from jaxkv.models.hf_loading import load_hf_checkpoint, save_hf_checkpoint
from jaxkv.models.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer

__all__ = [
    "Family",
    "Model",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "byte_tokenizer",
    "forward",
    "from_hf_config",
    "init_model",
    "init_params",
    "load_hf_checkpoint",
    "load_tokenizer",
    "preset",
    "save_hf_checkpoint",
    "scan_layers",
    "to_hf_config",
]
