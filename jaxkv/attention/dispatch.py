"""The backend setting: which implementation an attention runs, chosen explicitly.

  "xla"        plain jnp (CPU, TPU, and the oracle the kernels are tested against);
  "pallas"     Pallas kernels lowered through Triton (NVIDIA GPUs);
  "interpret"  the same Pallas kernels in the Pallas interpreter (CPU tests).

An unsupported backend is an error, never a silent fallback.
"""

from __future__ import annotations

import enum

import jax

# Tile of the block-sparse kernel (queries and keys); shorter sequences use the next power of two
# >= 16 (the kernel's minimum).
PREFILL_BLOCK = 64
# Query rows of one paged-kernel program when a chunk's G * C rows of a KV head exceed it.
CHUNK_ROWS = 64


class Backend(enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"


def resolve_backend(backend: str | Backend) -> Backend:
    """The `Backend` of a name (or the enum itself), validated: "pallas" needs an NVIDIA GPU
    (Triton); the others run anywhere. Public entry points (`jaxkv.generate`,
    `compress_prompt`, `forward`, `forward_cached`) call it once and pass the enum down, so
    jitted functions are keyed on the enum."""
    try:
        resolved = Backend(backend)
    except ValueError:
        allowed = ", ".join(repr(b.value) for b in Backend)
        raise ValueError(f"backend={backend!r}: allowed are {allowed}") from None
    if resolved is Backend.PALLAS and jax.default_backend() != "gpu":
        raise ValueError(
            f"backend='pallas' lowers through Triton and needs an NVIDIA GPU; the default JAX "
            f"backend here is {jax.default_backend()!r}: use backend='interpret' (the Pallas "
            "interpreter) or 'xla'"
        )
    return resolved


def uses_kernels(backend: str | Backend) -> bool:
    """Whether `backend` runs the Pallas kernels (validating it)."""
    return resolve_backend(backend) is not Backend.XLA


def interpret(backend: str | Backend) -> bool:
    """Whether the kernels run in the Pallas interpreter."""
    return resolve_backend(backend) is Backend.INTERPRET


def prefill_block(num_tokens: int) -> int:
    """The block-sparse kernel's tile for a sequence of `num_tokens`."""
    return min(PREFILL_BLOCK, max(16, 1 << max(num_tokens - 1, 0).bit_length()))
