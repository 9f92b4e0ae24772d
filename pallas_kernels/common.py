"""Pieces shared by the Pallas kernels: masking constant, Triton launch parameters, checks."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

# Finite, so that `exp(MASK_VALUE - MASK_VALUE)` and sums stay NaN-free; rows without any visible
# key are detected by their zero softmax denominator, never by comparing against this value.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# jax >= 0.11 warns on every lowering through Triton, which is still the default GPU lowering
# through 0.12 and the one these kernels target. Only that message is silenced.
warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """Matrix product with an f32 result; f32 operands multiply in full f32 (Triton would
    otherwise round them to tf32, an error near 1e-3), bf16 operands on the tensor cores."""
    full_precision = a.dtype == jnp.float32 or b.dtype == jnp.float32
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=not full_precision)


def triton_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Launch parameters of the Triton lowering (ignored by the interpreter)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def check_tile(name: str, value: int, minimum: int = 1) -> None:
    """Triton needs power-of-two tiles, and dot operands of at least 16 in each dimension."""
    if not isinstance(value, int) or not is_power_of_two(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be a power of two >= {minimum}")


def next_power_of_two(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
