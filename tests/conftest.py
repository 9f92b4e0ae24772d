"""Test setup: virtual CPU devices for sharding tests, GPU marker handling, shared fixtures."""

import os

# Must be set before jax initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    if has_gpu:
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _full_precision_matmuls_on_gpu(request):
    """XLA on a GPU multiplies f32 in TF32 by default (errors near 1e-3), while the kernels
    multiply f32 in full f32: GPU tests compare both at full precision, so that a difference is
    the kernel's and not the reference's rounding."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
