"""What a `--model` argument names, loaded with its tokenizer.

One resolver for the CLI, training and benchmarks: a checkpoint directory (Hugging Face layout,
its own tokenizer.json), a .gguf file, a model fetched by name (`jaxkv fetch NAME`) or a built-in
preset (random weights, the byte-level tokenizer).
"""

from __future__ import annotations

from pathlib import Path

from jaxkv import bundled, downloads
from jaxkv.models import (
    Model,
    Tokenizer,
    byte_tokenizer,
    gguf_tokenizer,
    init_model,
    load_gguf,
    load_hf_checkpoint,
    load_tokenizer,
    preset,
)
from jaxkv.models.configs import PRESETS, dtype_from_name


def model_path(model_arg: str | Path) -> Path:
    """The file or directory `model_arg` names (a fetched model's name resolves to its file)."""
    model_arg = str(model_arg)
    return (
        downloads.model_path(model_arg) if model_arg in downloads.KNOWN_MODELS else Path(model_arg)
    )


def check_model_arg(model_arg: str | Path) -> Path | None:
    """The file or directory `model_arg` names, or None for a preset, checked without loading
    anything (a real model takes tens of seconds to load): a FileNotFoundError says what is
    missing, a path that does not exist or an unfetched known model."""
    path = model_path(model_arg)
    if (path.is_file() and path.suffix == ".gguf") or path.is_dir():
        return path
    if str(model_arg) in PRESETS:
        return None
    known = (
        f"give a checkpoint directory, a .gguf file, a known model "
        f"({', '.join(downloads.KNOWN_MODELS)}) or a preset ({', '.join(sorted(PRESETS))})"
    )
    if path.is_file():
        raise FileNotFoundError(f"--model {str(model_arg)!r}: a file that is not a .gguf; {known}")
    raise FileNotFoundError(f"--model {str(model_arg)!r}: not found; {known}")


def load_model(
    model_arg: str | Path, dtype: str | None = None, seed: int = 0
) -> tuple[Model, Tokenizer]:
    """(model, tokenizer) of a checkpoint directory, a .gguf file, a fetched model's name or a
    preset. dtype: the parameters' (default: the checkpoint's own; GGUF and presets: float32)."""
    path = check_model_arg(model_arg)
    if path is None:
        model = init_model(
            preset(str(model_arg)), seed=seed, dtype=dtype_from_name(dtype or "float32")
        )
        return model, byte_tokenizer()
    if path.is_dir():
        model = load_hf_checkpoint(path, dtype=dtype)
        return model, load_tokenizer(path)  # never the byte-level one in its place
    return load_gguf(path, dtype=dtype or "float32"), gguf_tokenizer(path)


def short_name(model_arg: str | Path) -> str:
    """A short name for `--model` (what a server answers to): the name jaxkv ships or fetched
    it under, else a preset's name, a checkpoint directory's name or a file's stem."""
    known = shipped_name(model_arg)
    if known is not None:
        return known
    return Path(str(model_arg)).name.removesuffix(".gguf")


def shipped_name(model_arg: str | Path) -> str | None:
    """The name jaxkv ships trained policy parameters under for this `--model`
    (`jaxkv.bundled.SHIPPED_PARAMS`): `bundled.REFERENCE` for the bundled reference model, a
    fetched model's name for that name or its fetched file; None for any other model."""
    arg = str(model_arg)
    if arg in downloads.KNOWN_MODELS:
        return arg
    path = Path(arg).resolve()
    if path == bundled.REFERENCE_MODEL:
        return bundled.REFERENCE
    fetched = {downloads.fetched_path(name).resolve(): name for name in downloads.KNOWN_MODELS}
    return fetched.get(path)


def model_file_sha256(model_arg: str | Path) -> str | None:
    """The pinned sha256 of a fetched model (None for anything else): provenance for results."""
    known = downloads.KNOWN_MODELS.get(str(model_arg))
    return None if known is None else known.sha256


def stop_tokens(tokenizer: Tokenizer, config) -> list[int]:
    """Generation ends at the tokenizer's end token and at every id of the config's eos list
    (end of sequence and end of turn: chat models finish a reply with the latter)."""
    ids = ([tokenizer.eos_id] if tokenizer.eos_id is not None else []) + list(config.eos_token_ids)
    return list(dict.fromkeys(ids))
