"""The backend setting: which implementation an attention runs, chosen explicitly.

  "xla"        plain jnp (CPU, TPU, and the oracle the kernels are tested against);
  "pallas"     Pallas kernels lowered through Triton (NVIDIA GPUs);
  "interpret"  the same Pallas kernels in the Pallas interpreter (CPU tests);
  "auto"       "pallas" where JAX's default backend is a GPU, else "xla". TPUs get "xla": jaxkv
               has no Pallas (Mosaic) path for them yet.

An unsupported backend is an error, never a silent fallback.

Where "pallas" is checked: where the platform is known, when a program is lowered. A CPU host
may lower (or export) a program for CUDA, `jax.jit(f).trace(...).lower(lowering_platforms=
("cuda",))`, and tracing happens before the platforms are given, so neither `resolve_backend` nor
anything at trace time can tell; `resolve_backend("pallas")` accepts it on any host. Instead each
Triton kernel call takes its query through `platform_checked`: an identity primitive whose
lowering rule is the identity for "cuda" and "rocm" and raises `pallas_platform_error` (a
`ValueError` naming backend='pallas', the platform and the alternatives) for any other platform,
and whose eager evaluation checks the array's devices. It feeds the kernel, so it is lowered
before the `pallas_call`, whose own CPU error ("Only interpret mode is supported on CPU backend.")
names neither the setting nor the alternatives. So `jaxkv.generate(..., backend="pallas")` on a
CPU fails when its first program is lowered for the CPU, while the same program lowered for
"cuda" holds the Triton calls (tests/test_lowering.py). Call sites that only run programs here
(a CLI, a benchmark) can fail before any tracing with `check_runs_here`.
"""

from __future__ import annotations

import enum

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

# Tile of the block-sparse kernel (queries and keys); shorter sequences use the next power of two
# >= 16 (the kernel's minimum).
PREFILL_BLOCK = 64
# Query rows of one paged-kernel program when a chunk's G * C rows of a KV head exceed it.
CHUNK_ROWS = 64

# Lowering platforms the Triton kernels lower for, and JAX's device platform name for both.
TRITON_PLATFORMS = ("cuda", "rocm")
_GPU_DEVICE_PLATFORM = "gpu"


class Backend(enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"
    AUTO = "auto"


def resolve_backend(backend: str | Backend) -> Backend:
    """The `Backend` of a name (or the enum itself), validated; never `Backend.AUTO`: "auto"
    resolves to PALLAS where `jax.default_backend()` is "gpu" and to XLA elsewhere (CPU, and TPU,
    which has no jaxkv Pallas path yet). "pallas" is accepted on any host: a program that uses it
    fails when lowered for a platform other than a GPU (see the module docstring). Public entry
    points (`jaxkv.generate`, `compress_prompt`, `forward`, `forward_cached`) call it once and pass
    the enum down, so jitted functions are keyed on the resolved enum."""
    try:
        resolved = Backend(backend)
    except ValueError:
        allowed = ", ".join(repr(b.value) for b in Backend)
        raise ValueError(f"backend={backend!r}: allowed are {allowed}") from None
    if resolved is Backend.AUTO:
        return Backend.PALLAS if jax.default_backend() == _GPU_DEVICE_PLATFORM else Backend.XLA
    return resolved


def pallas_platform_error(platforms) -> ValueError:
    """The error of backend "pallas" on `platforms` (lowering or device platform names)."""
    named = ", ".join(repr(p) for p in platforms)
    return ValueError(
        f"backend='pallas' lowers through Triton and needs an NVIDIA GPU; this program targets "
        f"platform {named}: use backend='interpret' (the Pallas interpreter), 'xla', or 'auto' "
        "(the kernels on a GPU, 'xla' elsewhere)"
    )


def check_runs_here(backend: str | Backend) -> Backend:
    """`resolve_backend`, and for "pallas" the check that JAX's default backend is a GPU: for call
    sites that run programs here (CLIs, benchmarks) and want the error before any tracing."""
    resolved = resolve_backend(backend)
    if resolved is Backend.PALLAS and jax.default_backend() != _GPU_DEVICE_PLATFORM:
        raise pallas_platform_error([jax.default_backend()])
    return resolved


def uses_kernels(backend: str | Backend) -> bool:
    """Whether `backend` runs the Pallas kernels (validating it)."""
    return resolve_backend(backend) is not Backend.XLA


def interpret(backend: str | Backend) -> bool:
    """Whether the kernels run in the Pallas interpreter."""
    return resolve_backend(backend) is Backend.INTERPRET


def platform_checked(x: jax.Array, backend: str | Backend) -> jax.Array:
    """`x` itself; under backend "pallas", marked so that lowering the program for a platform
    without Triton (or running it eagerly on such a device) raises `pallas_platform_error`.
    Kernel dispatch passes a kernel's query through it (see the module docstring)."""
    if resolve_backend(backend) is not Backend.PALLAS:
        return x
    return _pallas_platform_p.bind(x)


def _check_devices(x):
    platforms = sorted({device.platform for device in x.devices()})
    if platforms != [_GPU_DEVICE_PLATFORM]:
        raise pallas_platform_error(platforms)
    return x


def _unsupported_platform_lowering(ctx: mlir.LoweringRuleContext, x):
    platforms = ctx.platforms or ctx.module_context.platforms
    raise pallas_platform_error([p for p in platforms if p not in TRITON_PLATFORMS])


_pallas_platform_p = Primitive("jaxkv_pallas_platform_check")
_pallas_platform_p.def_impl(_check_devices)
_pallas_platform_p.def_abstract_eval(lambda aval: aval)
# Tangents and batch dimensions pass through: the check is on the primal program.
ad.primitive_jvps[_pallas_platform_p] = lambda primals, tangents: (
    _pallas_platform_p.bind(*primals),
    tangents[0],
)
batching.primitive_batchers[_pallas_platform_p] = lambda args, dims: (
    _pallas_platform_p.bind(*args),
    dims[0],
)
mlir.register_lowering(_pallas_platform_p, _unsupported_platform_lowering)
for _platform in TRITON_PLATFORMS:
    mlir.register_lowering(_pallas_platform_p, lambda ctx, x: [x], platform=_platform)


def prefill_block(num_tokens: int) -> int:
    """The block-sparse kernel's tile for a sequence of `num_tokens`."""
    return min(PREFILL_BLOCK, max(16, 1 << max(num_tokens - 1, 0).bit_length()))
