"""The backend setting: which implementation an attention runs, chosen explicitly.

  "xla"            plain jnp (CPU, TPU, and the oracle the kernels are tested against);
  "pallas"         Pallas kernels, picked by the platform a program is lowered for: on NVIDIA
                   GPUs every kernel through Triton; on TPUs (Mosaic) jaxkv's paged decode
                   kernel and jax's splash attention for causal prefill, the rest of prefill
                   (WG-KV's gate bias, block lists) in jnp: jaxkv has no TPU block-sparse kernel;
  "interpret"      the Triton kernels in the Pallas interpreter (CPU tests);
  "interpret-tpu"  the TPU path in the interpreters (CPU tests; the decode kernel's DMAs and
                   semaphores simulated);
  "auto"           "pallas" where JAX's default backend is a GPU, else "xla". TPUs get "xla": the
                   Mosaic kernel has run in the interpreter and been lowered for "tpu", never
                   compiled by libtpu nor timed on a TPU, so it is opt-in there.

An unsupported backend is an error, never a silent fallback.

Where "pallas" picks its kernel: where the platform is known, when a program is lowered. A CPU
host may lower (or export) a program for a GPU or a TPU, `jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))`, and tracing happens before the platforms are given, so neither
`resolve_backend` nor anything at trace time can tell. `on_platform` stages both implementations
with `jax.lax.platform_dependent`, which keeps only the lowering platform's. Its first operand
goes through an identity primitive whose lowering rule is the identity for
"cuda", "rocm" and "tpu" and raises `pallas_platform_error` (a `ValueError` naming
backend='pallas', the platform and the alternatives) for any other platform, and whose eager
evaluation checks the array's devices. So `jaxkv.generate(..., backend="pallas")` on a CPU fails
when its first program is lowered for the CPU, while the same program lowered for "cuda" holds
the Triton calls and lowered for "tpu" the Mosaic calls (tests/test_lowering.py). Call sites that
only run programs here (a CLI, a benchmark) can fail before any tracing with `check_runs_here`.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

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
# Lowering (and device) platform of the Mosaic kernels.
MOSAIC_PLATFORM = "tpu"
PALLAS_PLATFORMS = (*TRITON_PLATFORMS, MOSAIC_PLATFORM)
_PALLAS_DEVICE_PLATFORMS = (_GPU_DEVICE_PLATFORM, MOSAIC_PLATFORM)


class Backend(enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"
    INTERPRET_TPU = "interpret-tpu"
    AUTO = "auto"


def resolve_backend(backend: str | Backend) -> Backend:
    """The `Backend` of a name (or the enum itself), validated; never `Backend.AUTO`: "auto"
    resolves to PALLAS where `jax.default_backend()` is "gpu" and to XLA elsewhere (CPU, and TPU:
    see the module docstring). "pallas" is accepted on any host: a program that uses it fails
    when lowered for a platform other than a GPU or a TPU. Public entry
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
        f"backend='pallas' needs an NVIDIA GPU (Triton) or a TPU (Mosaic); this program targets "
        f"platform {named}: use backend='interpret' or 'interpret-tpu' (the kernels in an "
        "interpreter), 'xla', or 'auto' (the kernels on a GPU, 'xla' elsewhere)"
    )


def check_runs_here(backend: str | Backend) -> Backend:
    """`resolve_backend`, and for "pallas" the check that JAX's default backend is a GPU or a
    TPU: for call sites that run programs here (CLIs, benchmarks) and want the error before any
    tracing."""
    resolved = resolve_backend(backend)
    if resolved is Backend.PALLAS and jax.default_backend() not in _PALLAS_DEVICE_PLATFORMS:
        raise pallas_platform_error([jax.default_backend()])
    return resolved


def uses_kernels(backend: str | Backend) -> bool:
    """Whether `backend` runs the Pallas kernels (validating it)."""
    return resolve_backend(backend) is not Backend.XLA


def on_platform(backend: str | Backend, *operands, gpu: Callable, tpu: Callable):
    """An attention through the kernels of the platform it runs on, for a kernel `backend`.

    `gpu(*operands, interpret=)` runs the Triton kernels, `tpu(*operands, interpret=)` the TPU
    path (a Mosaic kernel, or jnp where jaxkv has none); `interpret` says whether in the
    interpreter. "interpret" and "interpret-tpu" call one of them here; "pallas" stages both
    with `jax.lax.platform_dependent`, the first operand through the platform check, so the
    lowering platform keeps one and any other platform is an error (module docstring).
    Operands are arrays or pytrees of them (None for an absent one); static settings belong in
    the callables.
    """
    resolved = resolve_backend(backend)
    if resolved is Backend.INTERPRET:
        return gpu(*operands, interpret=True)
    if resolved is Backend.INTERPRET_TPU:
        return tpu(*operands, interpret=True)
    if resolved is not Backend.PALLAS:
        raise ValueError(
            f"backend={resolved.value!r} runs no kernels: on_platform needs one that does"
        )
    first, *rest = operands
    on_gpu = functools.partial(gpu, interpret=False)
    return jax.lax.platform_dependent(
        _pallas_platform_p.bind(first),
        *rest,
        cuda=on_gpu,
        rocm=on_gpu,
        tpu=functools.partial(tpu, interpret=False),
    )


def _check_devices(x):
    platforms = sorted({device.platform for device in x.devices()})
    if len(platforms) != 1 or platforms[0] not in _PALLAS_DEVICE_PLATFORMS:
        raise pallas_platform_error(platforms)
    return x


def _unsupported_platform_lowering(ctx: mlir.LoweringRuleContext, x):
    platforms = ctx.platforms or ctx.module_context.platforms
    raise pallas_platform_error([p for p in platforms if p not in PALLAS_PLATFORMS])


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
for _platform in PALLAS_PLATFORMS:
    mlir.register_lowering(_pallas_platform_p, lambda ctx, x: [x], platform=_platform)


def prefill_block(num_tokens: int) -> int:
    """The block-sparse kernel's tile for a sequence of `num_tokens`."""
    return min(PREFILL_BLOCK, max(16, 1 << max(num_tokens - 1, 0).bit_length()))
