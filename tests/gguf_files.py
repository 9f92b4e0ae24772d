"""Tiny GGUF files written as llama.cpp's converter writes them, for tests (no downloads).

A random `transformers` model (Llama with GQA, Qwen2 with q/k/v biases, Qwen3 with q/k norms) and
a small byte-level BPE tokenizer trained here are written with `gguf.GGUFWriter`: llama.cpp's
tensor names, its Llama Q/K row order (each head's rows interleaved, written plainly below and
independent of the loader's inverse), quantised with `gguf.quants` (F16, Q8_0, Q4_1, ...). For
K-quants, which `gguf` cannot quantise, the blocks are random bytes with finite scales: loaders
must still agree on what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TRAINING_TEXT = [
    "The special magic number for amber-otter is 4821937. What is it? It is 4821937.",
    "def lookup(table, key):\n    return table[key]  # 3.14159, 2,718 and 1e10\n",
    "Ελληνικά, café, naïve, 東京 and emoji 😀 are bytes too. Don't they'll I'm.",
] * 20


def train_tokenizer(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges "a b") of a byte-level BPE trained on a fixed text; specials first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


ARCHITECTURES = {
    # name: (transformers config class, GGUF architecture, config kwargs, tokenizer pre)
    "llama-gqa": (
        transformers.LlamaConfig,
        "llama",
        dict(head_dim=64, rope_theta=500000.0, tie_word_embeddings=False),
        "default",
    ),
    "qwen2-bias": (
        transformers.Qwen2Config,
        "qwen2",
        dict(rope_theta=1000000.0, tie_word_embeddings=True),
        "qwen2",
    ),
    "qwen3-qknorm": (
        transformers.Qwen3Config,
        "qwen3",
        # transformers' GGUF reader takes Qwen3's head dim from its own default (128), not from
        # the file's key_length: the reference can only load files with that head dim.
        dict(head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False),
        "llama-bpe",
    ),
}
VOCAB_SIZE = 320


def random_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random f32 model (hidden 256, so K-quant rows of 256 fit) with non-trivial norms/biases."""
    config_cls, _, kwargs, _ = ARCHITECTURES[name]
    config = config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    return model


def llama_cpp_row_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K permutation: per head, rows i and i + H/2 become 2i and 2i+1."""
    head_dim = weight.shape[0] // heads
    out = np.empty_like(weight)
    for head in range(heads):
        rows = weight[head * head_dim : (head + 1) * head_dim]
        half = head_dim // 2
        out[head * head_dim : (head + 1) * head_dim][0::2] = rows[:half]
        out[head * head_dim : (head + 1) * head_dim][1::2] = rows[half:]
    return out


_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors(model: transformers.PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, Llama Q/K rows in llama.cpp's order."""
    config = model.config
    tensors = {}
    for name, param in model.state_dict().items():
        array = param.detach().numpy().astype(np.float32)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in _NAMES:
            tensors[_NAMES[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            array = llama_cpp_row_order(array, config.num_attention_heads)
        if arch == "llama" and rest == "self_attn.k_proj.weight":
            array = llama_cpp_row_order(array, config.num_key_value_heads)
        tensors[f"blk.{layer}.{_LAYER_NAMES[rest]}"] = array
    return tensors


# Bytes per block of 256 values, and a range of block scales giving weights of about 0.1.
_K_BLOCKS = {"Q4_K": (144, 1e-4), "Q5_K": (176, 5e-5), "Q6_K": (210, 2e-5)}


def random_k_quant(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (uint8 [rows, cols/256 * block bytes]) with small finite scales."""
    block, scale = _K_BLOCKS[kind]
    data = rng.integers(0, 256, (rows, cols // 256, block), dtype=np.uint8)
    scale = rng.uniform(scale / 2, scale, (rows, cols // 256)).astype(np.float16).view(np.uint8)
    scale = scale.reshape(rows, cols // 256, 2)
    if kind == "Q6_K":  # d is the block's last 2 bytes
        data[..., -2:] = scale
    else:  # d then dmin lead the block
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, -1)


def _quantised(name: str, array: np.ndarray, kind: str, rng) -> tuple[np.ndarray, object]:
    """(data, GGML type) as the converter stores it: norms and biases stay F32."""
    qtype = gguf.GGMLQuantizationType[kind]
    if array.ndim == 1 or kind == "F32":
        return array, gguf.GGMLQuantizationType.F32
    if kind == "F16":
        return array.astype(np.float16), qtype
    if kind in _K_BLOCKS:
        return random_k_quant(*array.shape, kind, rng), qtype
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    arch: str,
    tensor_type: str,
    pre: str = "default",
    seed: int = 0,
) -> Path:
    """Writes `model` and a trained tokenizer into a GGUF file as llama.cpp's converter does."""
    config = model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens, merges = train_tokenizer(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    types = [3 if t in SPECIALS else 1 for t in tokens]
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, array in gguf_tensors(model, arch).items():
        data, qtype = _quantised(name, array, tensor_type, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_qwen2(directory: Path) -> Path:
    """`directory/tiny.gguf`: a random Qwen2 (with q/k/v biases) in F16 and a tokenizer of its
    own (not byte-level), the file the model-file tests share."""
    path = directory / "tiny.gguf"
    return write_gguf(path, random_model("qwen2-bias"), "qwen2", "F16", "qwen2")
