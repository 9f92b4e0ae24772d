"""Functional Llama / Qwen decoders, their configs, checkpoints and tokenizers."""

from jaxkv.models.chat import chat_halves, encode_chat, render_chat
from jaxkv.models.configs import (
    Family,
    ModelConfig,
    RopeScaling,
    from_hf_config,
    preset,
    to_hf_config,
)
from jaxkv.models.decoder import Model, forward, init_model, init_params, scan_layers
from jaxkv.models.gguf_loading import load_gguf
from jaxkv.models.gguf_tokenizer import gguf_tokenizer
from jaxkv.models.hf_loading import load_hf_checkpoint, save_hf_checkpoint
from jaxkv.models.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer

__all__ = [
    "Family",
    "Model",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "byte_tokenizer",
    "chat_halves",
    "encode_chat",
    "forward",
    "gguf_tokenizer",
    "from_hf_config",
    "init_model",
    "init_params",
    "load_gguf",
    "load_hf_checkpoint",
    "load_tokenizer",
    "preset",
    "render_chat",
    "save_hf_checkpoint",
    "scan_layers",
    "to_hf_config",
]
